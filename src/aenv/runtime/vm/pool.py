"""Pre-started sandboxes per template: the spawner decides how far each entry is prepared (the
runtime restores them and waits for envd, see ``VmRuntime._spawn_warm``).

Entries are per template key and network mode (restricted or not is a netdev option fixed at
spawn). The pool owns its entries until ``take`` hands one out; ``aclose`` kills what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Awaitable, Callable

from .sandbox import VmSandbox

log = logging.getLogger(__name__)

PoolKey = tuple[str, bool]  # (template key, allow_internet)
Spawner = Callable[[str, str, bool], Awaitable[VmSandbox]]  # (name, template key, allow_internet)


class RestorePool:
    def __init__(self, size: int, spawn: Spawner) -> None:
        self.size = size
        self._spawn = spawn
        self._ready: dict[PoolKey, list[VmSandbox]] = {}
        self._fillers: dict[PoolKey, asyncio.Task[None]] = {}
        self._closed = False

    def take(self, template_key: str, allow_internet: bool, refill: bool = True) -> VmSandbox | None:
        """A waiting process for this template, or None. ``refill``: start replacing it in the
        background now; False when the caller calls :meth:`want` once its own work is done (a
        process spawning beside a restore slows the restore down on a small machine)."""
        key = (template_key, allow_internet)
        entries = self._ready.get(key, [])
        sbx = entries.pop(0) if entries else None
        if refill:
            self.want(template_key, allow_internet)
        return sbx

    def want(self, template_key: str, allow_internet: bool) -> None:
        key = (template_key, allow_internet)
        if self._closed or self.size <= 0:
            return
        task = self._fillers.get(key)
        if task is None or task.done():
            self._fillers[key] = asyncio.create_task(self._fill(key), name=f"vm-pool-{template_key}")

    async def _fill(self, key: PoolKey) -> None:
        entries = self._ready.setdefault(key, [])
        failures = 0
        while not self._closed and len(entries) < self.size and failures < 3:
            name = f"pool-{secrets.token_hex(5)}"
            try:
                sbx = await self._spawn(name, key[0], key[1])
            except Exception as exc:  # noqa: BLE001 - a failed pre-spawn only costs the fast path
                failures += 1
                log.warning("vm pool %s: pre-spawn failed: %s", key[0], exc)
                continue
            if self._closed:
                await sbx.aclose()
                return
            entries.append(sbx)

    async def drop_template(self, template_key: str) -> None:
        """End the entries of a template that is going away (both network modes), and the spawns
        in flight for it; a later :meth:`want` starts again from nothing."""
        keys = [k for k in {*self._ready, *self._fillers} if k[0] == template_key]
        fillers = [t for k in keys if (t := self._fillers.pop(k, None)) is not None]
        for t in fillers:
            t.cancel()
        for t in fillers:
            with contextlib.suppress(BaseException):
                await t
        for key in keys:
            for sbx in self._ready.pop(key, []):
                await sbx.aclose()

    def template_keys(self) -> set[str]:
        """The templates this pool holds or fills entries for."""
        return {k[0] for k in {*self._ready, *self._fillers}}

    def names(self) -> set[str]:
        return {s.name for entries in self._ready.values() for s in entries}

    def ready_counts(self) -> dict[str, int]:
        """Entries ready to hand out, per template key (both network modes)."""
        out: dict[str, int] = {}
        for (template_key, _), entries in self._ready.items():
            out[template_key] = out.get(template_key, 0) + len(entries)
        return out

    async def aclose(self) -> None:
        self._closed = True
        for t in self._fillers.values():
            t.cancel()
        for t in self._fillers.values():
            with contextlib.suppress(BaseException):
                await t
        for entries in self._ready.values():
            for sbx in entries:
                await sbx.aclose()
        self._ready.clear()

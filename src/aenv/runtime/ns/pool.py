"""Warm pool: sandboxes started ahead of time, so ``create`` only has to hand one out.

Starting a sandbox costs ~0.3 s (two interpreters, envd's imports); handing a ready one out costs a
cgroup rename, a directory rename, limit writes and one ``POST /init`` - a few milliseconds. A key is
everything that shapes a sandbox before hand-out (template, network mode); limits and identity are
applied at hand-out. The uid range (``SandboxSpec.uid_slot``, a team's on a server with several) is part
of the key: a pooled sandbox's processes already run in one, and never move to another. A key becomes "hot" the first time it is asked for (or via ``NsRuntime.warm``)
and is then refilled in the background after every take.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aenv.runtime.base import SandboxImage
from aenv.runtime.ns.sandbox import NsSandbox

log = logging.getLogger("aenv.runtime.ns")

Factory = Callable[[SandboxImage, bool, int], Awaitable[NsSandbox]]  # (template, internet, uid slot)


def pool_key(template: SandboxImage, allow_internet: bool, uid_slot: int = 0) -> str:
    lowers = ":".join(str(p) for p in (template.lowers or (template.rootfs,)))
    env = ",".join(f"{k}={v}" for k, v in sorted(template.env.items()))
    return (f"{template.template_id}|{lowers}|{template.user}|{template.start_cmd}|{env}|net={int(allow_internet)}"
            f"|uid={uid_slot}")


@dataclass
class _Slot:
    template: SandboxImage
    allow_internet: bool
    uid_slot: int
    ready: deque[NsSandbox] = field(default_factory=deque)
    filling: asyncio.Task[None] | None = None
    taken: asyncio.Event = field(default_factory=asyncio.Event)  # a running fill counts its lack again
    failures: int = 0


class WarmPool:
    def __init__(self, size: int, factory: Factory, max_parallel: int = 2, refill_delay: float = 0.05) -> None:
        self.size = size
        # A refill starts a little after a take, so the fresh sandbox's first commands do not compete
        # with the next launch's interpreter start-ups (the launch itself runs at the lowest CPU weight).
        self.refill_delay = refill_delay
        self._factory = factory
        self._slots: dict[str, _Slot] = {}
        self._sem = asyncio.Semaphore(max_parallel)
        self._closed = False

    def names(self) -> set[str]:
        return {s.name for slot in self._slots.values() for s in slot.ready}

    def ready_count(self, template: SandboxImage, allow_internet: bool, uid_slot: int = 0) -> int:
        slot = self._slots.get(pool_key(template, allow_internet, uid_slot))
        return len(slot.ready) if slot else 0

    def ready_counts(self) -> dict[str, int]:
        """Ready sandboxes per template ID (every key of it together)."""
        out: dict[str, int] = {}
        for slot in self._slots.values():
            if slot.ready:
                out[slot.template.template_id] = out.get(slot.template.template_id, 0) + len(slot.ready)
        return out

    def take(self, template: SandboxImage, allow_internet: bool, uid_slot: int = 0) -> NsSandbox | None:
        """A ready sandbox for this key, or None. Marks the key hot and triggers a refill either way."""
        if self.size <= 0 or self._closed:
            return None
        key = pool_key(template, allow_internet, uid_slot)
        slot = self._slots.setdefault(key, _Slot(template, allow_internet, uid_slot))
        got: NsSandbox | None = None
        while slot.ready:
            cand = slot.ready.popleft()
            if cand.alive():
                got = cand
                break
            asyncio.create_task(cand.aclose())
        self._refill(slot)
        return got

    def want(self, template: SandboxImage, allow_internet: bool, uid_slot: int = 0) -> None:
        if self.size <= 0 or self._closed:
            return
        slot = self._slots.setdefault(pool_key(template, allow_internet, uid_slot),
                                      _Slot(template, allow_internet, uid_slot))
        self._refill(slot)

    async def wait_ready(self, template: SandboxImage, allow_internet: bool, n: int | None = None,
                         uid_slot: int = 0) -> None:
        """Wait until the slot holds ``n`` (default: size) ready sandboxes (tests, warm-up)."""
        want = self.size if n is None else n
        slot = self._slots.get(pool_key(template, allow_internet, uid_slot))
        while slot is not None and len(slot.ready) < want:
            if slot.filling is None or slot.filling.done():
                self._refill(slot)
            if slot.filling is not None:
                await asyncio.wait({slot.filling}, timeout=0.05)
            else:
                await asyncio.sleep(0.05)

    def _refill(self, slot: _Slot) -> None:
        if slot.filling is None or slot.filling.done():
            slot.filling = asyncio.create_task(self._fill(slot), name="ns-pool-fill")
        else:
            slot.taken.set()

    async def _fill(self, slot: _Slot) -> None:
        """Fill ``slot`` up to size, keeping its whole lack in flight (bounded by the parallel starts):
        a take while a start is under way begins the next at once, not after it. Measured during
        another team's burst of 200, where a restore takes 200-500 ms: one create every ~0.2 s
        emptied a pool of two refilled one start after another, and the create that found it empty
        paid a whole start (300-520 ms against 5-30 ms from the pool). An emptied pool is refilled
        without the refill delay."""
        if slot.ready:
            await asyncio.sleep(self.refill_delay)
        pending: list[asyncio.Task[NsSandbox]] = []  # in start order: the ready queue keeps it
        try:
            while not self._closed:
                slot.taken.clear()
                lacking = self.size - len(slot.ready) - len(pending)
                pending += [asyncio.ensure_future(self._one(slot)) for _ in range(max(0, lacking))]
                if not pending:
                    return
                taken = asyncio.ensure_future(slot.taken.wait())
                try:
                    await asyncio.wait({*pending, taken}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    taken.cancel()
                done = [t for t in pending if t.done()]
                pending = [t for t in pending if not t.done()]
                fresh = [t.result() for t in done if not t.cancelled() and t.exception() is None]
                errors = [t.exception() for t in done if not t.cancelled() and t.exception() is not None]
                if self._closed:
                    await asyncio.gather(*(s.aclose() for s in fresh), return_exceptions=True)
                    break
                slot.ready.extend(fresh)
                if errors:
                    slot.failures += 1
                    delay = min(30.0, 0.5 * 2 ** min(slot.failures, 6))
                    log.warning("pool fill for %s failed (%s); retry in %.1fs", slot.template.template_id, errors[0], delay)
                    await asyncio.sleep(delay)
                elif fresh:
                    slot.failures = 0
        finally:
            # cancelled (the pool closes or forgets the key), or closed: not gather's cancel, which
            # would drop a start that was done with its sandbox running
            await self._abandon(pending)

    @staticmethod
    async def _abandon(starts: list[asyncio.Task[NsSandbox]]) -> None:
        """The fill was cancelled: cancel the starts under way (each cleans up after itself), wait for
        them, and close every sandbox one of them had already made."""
        if not starts:
            return
        for t in starts:
            t.cancel()
        await asyncio.wait(starts)
        made = [t.result() for t in starts if not t.cancelled() and t.exception() is None]
        await asyncio.gather(*(s.aclose() for s in made), return_exceptions=True)

    async def _one(self, slot: _Slot) -> NsSandbox:
        async with self._sem:
            return await self._factory(slot.template, slot.allow_internet, slot.uid_slot)

    async def forget(self, template_id: str | None = None) -> None:
        """Kill the ready sandboxes of one template (all when None) and stop keeping it hot, e.g.
        after the template's rootfs was rebuilt: an overlay over a changed lower is undefined."""
        doomed = [k for k, s in self._slots.items() if template_id is None or s.template.template_id == template_id]
        victims: list[NsSandbox] = []
        for key in doomed:
            slot = self._slots.pop(key)
            if slot.filling is not None:
                slot.filling.cancel()
                with contextlib.suppress(BaseException):
                    await slot.filling
            victims.extend(slot.ready)
            slot.ready.clear()
        await asyncio.gather(*(v.aclose() for v in victims), return_exceptions=True)

    async def aclose(self) -> None:
        """Stop filling and kill every sandbox still waiting in the pool."""
        self._closed = True
        tasks = [s.filling for s in self._slots.values() if s.filling is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        victims = [sbx for s in self._slots.values() for sbx in s.ready]
        for s in self._slots.values():
            s.ready.clear()
        await asyncio.gather(*(v.aclose() for v in victims), return_exceptions=True)

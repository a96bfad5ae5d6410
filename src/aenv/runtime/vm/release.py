"""Pause to disk: a VM paused for long, or while the host runs low on memory, is saved into its run
dir and its QEMU ends, so a long pause holds no RAM; resume (or a snapshot) restores it.

Pause itself is ``stop`` (vCPUs halt, memory kept). :class:`Releaser` then either releases at once
(``vm_release_paused_after`` = 0), after that many seconds still paused, or earlier under memory
pressure: every ``pressure_interval`` s the watch releases paused VMs, the longest-paused first,
while the host's available memory is below ``vm_memory_low_mb`` (the policy is ``pressure.py``).

A VM on a frozen base RAM is saved *layered* (device state, the pages it changed, a link of its
base RAM image, then the ``released.json`` marker); one that owns its RAM (restored from a full
save) is saved as one migration stream (``released.full``). The state file or marker appears last
and is removed only once the VM is back, so its presence means "released" (:func:`is_released`)
across a server restart too. Release and load run under the sandbox's lock (``table.py``). The
layered marker records the machine (``compat.py``): a load on another one (QEMU upgraded meanwhile)
is refused before a QEMU starts, and the sandbox stays released.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from aenv.errors import StateError
from aenv.machine_key import MachineKey

from . import compat, memlayer, pressure
from .errors import translated
from .frozen import link_or_copy
from .machine import MachineError
from .sandbox import VmSandbox, child_config, own_ram_file, run_paths, spawn_on_frozen_ram, spawn_on_own_ram
from .table import RELEASED_FILES, RELEASED_LAYERED, RELEASED_STATE, Released, VmTable
from .template import TemplateCache
from .volumes import VolumeExports

log = logging.getLogger("aenv.runtime.vm")


def is_released(run_dir: Path) -> bool:
    """A complete saved state (stream or layered marker) is in ``run_dir``."""
    return (run_dir / RELEASED_STATE).is_file() or (run_dir / RELEASED_LAYERED).is_file()


class Releaser:
    """Releases paused VMs of ``table`` to disk and loads them back."""

    def __init__(self, table: VmTable, templates: TemplateCache, shm_dir: Path, release_after: float,
                 memory_low_mb: float, machine: Callable[[], MachineKey | None] = lambda: None,
                 exports: VolumeExports | None = None) -> None:
        self.table = table
        self.exports = exports  # E2B volume exports (volumes.py); None: no sandbox has volumes
        self.templates = templates
        self.shm_dir = shm_dir  # where a VM restored from a full save gets its own RAM file
        self.release_after = release_after  # s paused in RAM before release; 0: at once
        self.memory_low_mb = memory_low_mb  # see pressure.py; 0: no watch
        self.machine = machine  # this host's machine record: the layered marker keeps it (compat.py)
        self.pressure_interval = 1.0
        self._paused_since: dict[str, float] = {}  # paused and still in RAM: when it was paused
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._watch: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.memory_low_mb > 0 and self._watch is None:
            self._watch = asyncio.create_task(self._watch_pressure(), name="vm-memory-pressure")

    async def aclose(self) -> None:
        """Stop the watch and every pending release (paused VMs stay paused in RAM)."""
        tasks = [t for t in (self._watch, *self._tasks.values()) if t is not None]
        self._watch = None
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t

    # ---- when ----------------------------------------------------------------------------------
    def schedule(self, sandbox_id: str) -> None:
        """A paused VM in RAM: released after ``release_after`` s, or earlier under memory pressure."""
        self.cancel(sandbox_id)
        self._paused_since[sandbox_id] = time.monotonic()
        self._tasks[sandbox_id] = asyncio.create_task(self._release_later(sandbox_id), name=f"vm-release-{sandbox_id}")

    def cancel(self, sandbox_id: str) -> None:
        self._paused_since.pop(sandbox_id, None)
        task = self._tasks.pop(sandbox_id, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def adopted(self, sandbox_id: str, sbx: VmSandbox) -> None:
        """A VM re-attached after a restart: if it is paused, its idle clock restarts now."""
        with contextlib.suppress(MachineError):
            if self.release_after > 0 and await sbx.machine.status() == "paused":
                self.schedule(sandbox_id)

    async def _release_later(self, sandbox_id: str) -> None:
        await asyncio.sleep(self.release_after)
        async with self.table.lock(sandbox_id):
            if self._tasks.get(sandbox_id) is not asyncio.current_task():
                return  # resumed, killed or re-paused meanwhile
            self._tasks.pop(sandbox_id, None)
            if not await self._release_if_paused(sandbox_id):
                self._paused_since.pop(sandbox_id, None)  # not a paused VM in RAM any more

    async def _release_if_paused(self, sandbox_id: str) -> bool:
        """Release ``sandbox_id`` if it is still a stopped VM in RAM (lock held). Failures are logged:
        the VM then simply stays paused in RAM."""
        sbx = self.table.running.get(sandbox_id)
        try:
            if sbx is None or await sbx.machine.status() not in ("paused", "postmigrate"):
                return False
            return await self.release_unless_kept(sandbox_id)
        except (MachineError, OSError) as exc:
            log.warning("sandbox %s: could not release paused VM memory: %s", sandbox_id, exc)
            return False

    async def _watch_pressure(self) -> None:
        """Every ``pressure_interval`` s: while the host is below ``memory_low_mb`` available,
        release paused VMs, the longest-paused first (see pressure.py)."""
        while True:
            await asyncio.sleep(self.pressure_interval)
            try:
                await self.relieve_pressure()
            except Exception as exc:  # noqa: BLE001 - the watch must outlive one bad round
                log.warning("vm memory pressure round failed: %s", exc)

    async def relieve_pressure(self) -> list[str]:
        """One round: release paused VMs while memory is low. Returns the IDs released."""
        released: list[str] = []
        for sandbox_id in pressure.release_order(self._paused_since):
            available = await asyncio.to_thread(pressure.mem_available_mb)
            if not pressure.under_pressure(available, self.memory_low_mb):
                break
            async with self.table.lock(sandbox_id):
                if sandbox_id not in self._paused_since:
                    continue  # resumed or killed meanwhile
                self.cancel(sandbox_id)
                if await self._release_if_paused(sandbox_id):
                    released.append(sandbox_id)
                    log.info("sandbox %s: released under memory pressure (%.0f MB available, mark %.0f MB)",
                             sandbox_id, available or 0, self.memory_low_mb)
        return released

    # ---- to disk and back ----------------------------------------------------------------------
    @staticmethod
    def keep_reason(sbx: VmSandbox) -> str | None:
        """Why this paused VM must stay in RAM rather than go to disk, or None. Its volumes were in use
        when it paused (``VmSandbox.keep_in_ram``), or it owns its RAM (a cold boot) and mounts volumes:
        it could only be saved by a migration, which QEMU refuses while a 9p export is mounted."""
        if sbx.keep_in_ram is not None:
            return sbx.keep_in_ram
        if sbx.volumes and not _layered(sbx):
            return "it owns its RAM, and QEMU refuses to migrate a VM with a mounted volume export"
        return None

    async def release_unless_kept(self, sandbox_id: str) -> bool:
        """``release_locked`` unless the (stopped) VM must stay in RAM (``keep_reason``, logged)."""
        if (why := self.keep_reason(self.table.get(sandbox_id))) is not None:
            log.info("sandbox %s: paused VM kept in RAM: %s", sandbox_id, why)
            return False
        await self.release_locked(sandbox_id)
        return True

    async def release_locked(self, sandbox_id: str) -> None:
        """Save the (stopped) VM fully to its run dir and end QEMU; disk overlays stay. The state
        file is renamed into place only when complete, so its presence means "released"."""
        sbx = self.table.get(sandbox_id)
        spec = self.table.specs.get(sandbox_id)
        rel = Released(
            sbx.name, sbx.run_dir, sbx.template_key, sbx.disk_generation,
            spec.allow_internet if spec else sbx.machine.cfg.network == "user",
        )  # fmt: skip
        t0 = time.perf_counter()
        if _layered(sbx):
            size = await self._save_layered(sbx, rel)
        else:
            if (why := self.keep_reason(sbx)) is not None:  # the callers asked first; this is the guard
                raise StateError(f"sandbox {sandbox_id}: cannot be saved to disk: {why}", sandbox_id=sandbox_id)
            await sbx.machine.save_full(rel.state_file)
            size = rel.state_file.stat().st_size
        t_saved = time.perf_counter()
        await sbx.drop_session()
        await sbx.machine.kill(keep=[*sbx.run_dir.glob("root*.qcow2"), *(p for p in rel.files() if p.exists())])
        self.table.running.pop(sandbox_id, None)
        self._paused_since.pop(sandbox_id, None)
        self.table.released[sandbox_id] = rel
        log.info(
            "sandbox %s: paused VM released to disk (%.1f MB saved in %.0f ms, QEMU ended in %.0f ms)",
            sandbox_id, size / 1e6, (t_saved - t0) * 1000, (time.perf_counter() - t_saved) * 1000,
        )  # fmt: skip

    async def _save_layered(self, sbx: VmSandbox, rel: Released) -> int:
        """The stopped VM as device state + changed pages (+ its base RAM image, linked), the
        marker last; returns the bytes written. A few MB instead of all touched RAM."""
        base_ram, ram_image = sbx.base_ram, sbx.ram_image
        assert base_ram is not None and ram_image is not None
        machine = sbx.machine
        devices, layer, base = (rel.run_dir / n for n in RELEASED_FILES)
        await machine.save_devices(devices)

        def write() -> int:
            size = memlayer.save(layer, *memlayer.read_private(machine.pid, machine.ram_mapping()))
            link_or_copy(ram_image, base)
            tmp = rel.marker.with_name(f".{rel.marker.name}.tmp")
            marker = {"ram_id": base_ram.name.removesuffix(".mem"), "mem_chain": [p.name for p in sbx.mem_chain],
                      compat.RECORD: self.machine()}  # fmt: skip
            tmp.write_text(json.dumps(marker))
            os.rename(tmp, rel.marker)
            return size + devices.stat().st_size

        return await asyncio.to_thread(write)

    async def load_locked(self, sandbox_id: str, run: bool) -> VmSandbox:
        """A new QEMU from a released sandbox's saved state, paused (``run=False``) or running.
        The state files are removed only once the VM is back; on failure it stays released."""
        rel = self.table.released[sandbox_id]
        marker = json.loads(rel.marker.read_text()) if rel.marker.is_file() else None
        if marker is not None:  # e.g. QEMU upgraded while it was released: refused before a QEMU starts
            compat.check(marker, self.machine(), f"the paused state of sandbox '{sandbox_id}'", sandbox_id=sandbox_id)
        tpl = await self.templates.by_key(rel.template_key)
        top = run_paths(rel.run_dir)["root"]
        if rel.disk_generation:
            top = top.with_name(f"root.{rel.disk_generation}.qcow2")
        spec = self.table.specs.get(sandbox_id)
        share = await asyncio.to_thread(self.exports.prepare, spec) if self.exports and spec else None
        base = child_config(tpl.cfg, rel.name, rel.run_dir, rel.allow_internet, share)
        base = replace(base, drives=tuple(replace(d, path=top) if d.serial == "root" else d for d in base.drives))
        t0 = time.perf_counter()
        keep = [*rel.run_dir.glob("root*.qcow2"), *(p for p in rel.files() if p.exists())]
        if marker is not None:
            devices, layer, base_image = (rel.run_dir / n for n in RELEASED_FILES)
            ram = await self.templates.frozen_ram(str(marker["ram_id"]), base_image)
            machine = await spawn_on_frozen_ram(base, ram, rel.run_dir)
            try:
                await asyncio.to_thread(memlayer.apply, machine.pid, machine.ram_mapping(), [layer])
                await machine.restore(devices, resume=run)
            except BaseException:
                await machine.kill(keep=keep)
                raise
            sbx = VmSandbox(rel.name, machine, rel.run_dir, rel.template_key)
            # The base image stays linked in the run dir while this VM maps its RAM.
            sbx.base_ram, sbx.ram_image = ram, base_image
            sbx.mem_chain = [rel.run_dir / str(n) for n in marker.get("mem_chain") or []]
        else:
            machine = await spawn_on_own_ram(base, own_ram_file(self.shm_dir, sandbox_id), rel.run_dir)
            try:
                await machine.restore(rel.state_file, resume=run, ignore_shared=False)
            except BaseException:
                await machine.kill(keep=keep)
                raise
            sbx = VmSandbox(rel.name, machine, rel.run_dir, rel.template_key)
        sbx.restored = True
        sbx.disk_generation = rel.disk_generation
        sbx.volumes = spec.volumes if spec is not None and share is not None else ()  # mounted at its first HELLO
        self.table.running[sandbox_id] = sbx
        del self.table.released[sandbox_id]
        for p in rel.files():
            if p.name != "released.base":
                p.unlink(missing_ok=True)
        log.info("sandbox %s: restored from disk in %.0f ms", sandbox_id, (time.perf_counter() - t0) * 1000)
        return sbx

    async def loaded_locked(self, sandbox_id: str) -> VmSandbox:
        """The live VM of a sandbox, brought back (paused) from disk if it was released. The
        caller holds the sandbox's lock."""
        if sandbox_id not in self.table.released:
            return self.table.get(sandbox_id)
        with translated(sandbox_id, "restore from disk"):
            sbx = await self.load_locked(sandbox_id, run=False)
        if self.release_after > 0:
            self.schedule(sandbox_id)
        return sbx


def _layered(sbx: VmSandbox) -> bool:
    """A VM on a frozen RAM file (``share=off``): saved as device state + its changed pages."""
    return sbx.base_ram is not None and sbx.ram_image is not None and not sbx.machine.cfg.mem_share

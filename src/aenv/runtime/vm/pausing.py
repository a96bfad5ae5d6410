"""Pause and resume of a VM sandbox: which of its three paused forms a pause makes, and how each resumes.

Its own module because the choice spans three parts that ``runtime.py`` only wires together: a pause
in RAM is ``stop`` (vCPUs halt, memory kept), later saved to disk by the releaser (``release.py``); a
files-only pause ends QEMU and keeps the disk, and its resume boots on that disk (``coldboot.py``); a
resume of a VM saved to disk loads it into a new QEMU. Every step runs under the sandbox's lock
(``table.py``).
"""

from __future__ import annotations

from pathlib import Path

from aenv.errors import RuntimeFailure, StateError
from aenv.runtime.base import RuntimeState

from . import coldboot
from .errors import translated
from .machine import MachineError
from .release import Releaser
from .sandbox import VmSandbox
from .table import VmTable
from .template import TemplateCache
from .volumes import VolumeExports


class VmPausing:
    """Pauses and resumes the sandboxes of ``table`` (``VmRuntime.pause`` and ``resume``)."""

    def __init__(self, table: VmTable, templates: TemplateCache, release: Releaser, exports: VolumeExports, *,
                 shm_dir: Path, pids_limit: int, boot_timeout: float) -> None:
        self.table = table
        self.templates = templates
        self.release = release
        self.exports = exports
        self.shm_dir = shm_dir  # where a cold-booted VM gets its own RAM file
        self.pids_limit = pids_limit  # for /init after a cold boot
        self.boot_timeout = boot_timeout

    async def pause(self, sandbox_id: str, keep_memory: bool = True) -> RuntimeState:
        """``stop`` at once (vCPUs halt, memory kept); after ``vm_release_paused_after`` seconds
        still paused, the VM is saved to disk and QEMU ends (0: before this returns).
        ``keep_memory=False``: the guest syncs, QEMU ends, the disk stays (``coldboot.py``)."""
        async with self.table.lock(sandbox_id):
            rel = self.table.released.get(sandbox_id)
            if rel is not None and (keep_memory or not rel.memory):
                return self.table.state_of(sandbox_id)
            if not keep_memory:
                self.release.cancel(sandbox_id)
                with translated(sandbox_id, "pause (files only)", after="pause"):
                    await coldboot.stop_locked(self.table, sandbox_id)
                return self.table.state_of(sandbox_id)
            sbx = self.table.get(sandbox_id)
            await self._note_held_volumes(sandbox_id, sbx)
            with translated(sandbox_id, "pause"):
                # Streams end, the channel stays (VmSandbox.quiesce); envd keeps processes whose
                # client went away.
                sbx.quiesce()
                await sbx.machine.pause()
                if self.release.release_after <= 0:
                    await self.release.release_unless_kept(sandbox_id)
            if self.release.release_after > 0:
                self.release.schedule(sandbox_id)
            return self.table.state_of(sandbox_id)

    async def _note_held_volumes(self, sandbox_id: str, sbx: VmSandbox) -> None:
        """Before a pause: a VM whose volumes are in use stays in RAM while paused (a release to
        disk resumes in a new QEMU, whose export the guest could not mount again; see
        ``VmSandbox.volume_holders``)."""
        sbx.keep_in_ram = None
        if not sbx.volumes or await sbx.machine.status() != "running":
            return
        spec = self.table.specs.get(sandbox_id)
        try:
            held = await sbx.volume_holders(spec.access_token if spec else None)
        except (RuntimeFailure, MachineError, OSError, TimeoutError) as exc:
            held = [f"the guest could not be asked: {exc}"]
        if held:
            sbx.keep_in_ram = f"its volumes are in use ({'; '.join(held)})"

    async def resume(self, sandbox_id: str, keep_memory: bool = True) -> RuntimeState:
        """Back from RAM (``cont``), from disk (loaded into a new QEMU), or, without memory, a cold boot
        on its disk."""
        async with self.table.lock(sandbox_id):
            self.release.cancel(sandbox_id)
            rel = self.table.released.get(sandbox_id)
            if not keep_memory or (rel is not None and not rel.memory):
                spec = self.table.specs.get(sandbox_id)
                if spec is None:
                    raise StateError(f"sandbox {sandbox_id}: no spec to boot it with", sandbox_id=sandbox_id)
                with translated(sandbox_id, "cold boot", after="boot"):
                    await coldboot.stop_locked(self.table, sandbox_id)  # its memory, if any, is discarded
                    sbx = await coldboot.boot_locked(self.table, self.templates, sandbox_id, spec, shm_dir=self.shm_dir,
                                                     pids_limit=self.pids_limit, timeout=self.boot_timeout,
                                                     exports=self.exports)
                return self.table.state(sbx, spec)
            with translated(sandbox_id, "resume", after="resume"):
                if sandbox_id in self.table.released:
                    sbx = await self.release.load_locked(sandbox_id, run=True)
                else:
                    sbx = self.table.get(sandbox_id)
                    await sbx.machine.resume()
                # Clock and RNG: a HELLO on the kept session carries them (VmSandbox.refresh); a
                # VM loaded from disk has no session yet, and its first one's HELLO does (and
                # mounts its volumes from the new QEMU).
                await sbx.refresh()
                spec = self.table.specs.get(sandbox_id)
                await sbx.check_volumes(spec.access_token if spec else None)
            return self.table.state(sbx, self.table.specs.get(sandbox_id))

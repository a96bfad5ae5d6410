"""Snapshots, fork and rollback for the vm runtime (the ``SnapshotCapable`` half of ``VmRuntime``).

A vm snapshot is always full: device and vCPU state, guest RAM and the root disk, so a restore
resumes the processes where they were. Two formats:

* **layered** (a VM on a frozen RAM file, the usual case): the device state (``devices.state``),
  the pages the VM changed against its base RAM (``mem.<n>.layer``, :mod:`memlayer`) and a link of
  that base RAM's image (``base.ram``). The VM is paused only for a disk checkpoint, the device
  state and a read of its private pages; the layer file, the base RAM link and the disk flatten
  are written after the call returns while it runs on (``SnapshotResult.pending``; the snapshot dir
  holds ``UNFINISHED_MARKER`` until then). A snapshot of a VM restored from a snapshot stores only
  its changes against the parent's layers, linked in, up to ``MEM_CHAIN_MAX`` layers; past that it
  stores all its pages in one layer again.
* **stream** (a VM that owns its RAM: restored from a full save): one classic migration stream
  (``vm.full``) with all of RAM.

Either way ``disk.qcow2`` is the root disk flattened onto the template's disk. **Restore** (new
sandbox, fork child, rollback) writes the layers into a QEMU that maps the base RAM ``share=off``
and loads the device state, preferably into a QEMU the blank pool spawned ahead for the template
(its disk re-pointed at the snapshot's); a stream snapshot is migrated into a fresh RAM file.
**Rollback** keeps the sandbox's ID and token: the current VM ends, the snapshot is restored under
the same ID (envd's identity is set again unless it is the sandbox's own snapshot).

Every snapshot records the machine it restores on (``data["machine"]``, ``compat.py``); a restore or
rollback of one recorded on another machine is refused (``MachineMismatch``) before anything starts
or ends. Snapshots without a record restore as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from aenv.errors import Conflict, RuntimeFailure, StateError
from aenv.kinds import SnapshotMode
from aenv.machine_key import MachineKey
from aenv.runtime.base import UNFINISHED_MARKER, RuntimeState, SandboxSpec, SnapshotResult
from aenv.runtime.egress import ENFORCER

from . import compat, disk, memlayer, netjail
from .errors import translated
from .frozen import link_or_copy
from .machine import Machine, MachineError
from .pool import RestorePool
from .release import Releaser
from .sandbox import (
    VmSandbox,
    child_config,
    own_ram_file,
    remove_dirs,
    run_paths,
    spawn_on_frozen_ram,
    spawn_on_own_ram,
)
from .table import VmTable
from .template import TemplateCache
from .volumes import VolumeExports

log = logging.getLogger("aenv.runtime.vm")

SNAP_DISK = "disk.qcow2"  # in a snapshot dir: the root disk, flattened onto the template disk
FULL_STATE = "vm.full"  # in a snapshot dir: device state + guest RAM (classic migration stream)
# A layered snapshot (the default for a VM on a frozen RAM file): no RAM stream, but
DEVICE_STATE = "devices.state"  # device + vCPU state (xen-save-devices-state)
MEM_LAYER = "mem.layer"  # the pages the VM changed against its base RAM (memlayer)
BASE_RAM = "base.ram"  # that base RAM (hard link of the template's ram.img: stored once)
# A snapshot of a VM restored from a snapshot stores mem.<n>.layer: only its changes against the
# parent's layers (linked in as mem.0 ... mem.<n-1>). At this depth it stores all its pages in one
# layer again (compaction): deeper chains cost every restore one more file to read and apply.
MEM_CHAIN_MAX = 8
TEMPLATE_BUILD = "template_build"  # in a snapshot's data: the template build (its RAM id) its disk is layered on


class VmSnapshots:
    """Snapshot/fork/rollback flows over a runtime's sandboxes (``VmRuntime`` delegates to them)."""

    def __init__(self, table: VmTable, templates: TemplateCache, release: Releaser, blank_pool: RestorePool,
                 *, run_root: Path, shm_dir: Path, pids_limit: int, start: Callable[[], Awaitable[None]],
                 machine: Callable[[], MachineKey | None] = lambda: None,
                 exports: VolumeExports | None = None) -> None:
        self.table = table
        self.exports = exports  # E2B volume exports (volumes.py)
        self.templates = templates
        self.release = release
        # QEMUs spawned for a template and left waiting (not restored): a snapshot of that
        # template restores into one, its disk re-pointed (rollback, fork, create from snapshot).
        self.blank_pool = blank_pool
        self.run_root = run_root
        self.shm_dir = shm_dir
        self.pids_limit = pids_limit  # for /init (VmSandbox.init_envd)
        self._start = start  # the runtime's host-wide start (idempotent)
        self._machine = machine  # this host's machine record (compat.py), known once started
        self._overlay_locks: dict[Path, asyncio.Lock] = {}  # per snapshot dir: its empty overlay
        # Snapshot files still being written after the call returned: per snapshot dir, the
        # sandbox whose disk chain the task reads (its kill or rollback must wait) and the task.
        self._finishing: dict[Path, tuple[str, asyncio.Task[None]]] = {}

    # -- snapshot --
    async def snapshot(self, sandbox_id: str, into: Path, mode: SnapshotMode) -> SnapshotResult:
        """Always a full snapshot (processes, memory, files), whatever ``mode`` asks: a VM's memory
        is as cheap to save as its files."""
        async with self.table.lock(sandbox_id):  # no release to disk in the middle of a snapshot
            await self._start()
            sbx = await self.release.loaded_locked(sandbox_id)
            await self._refuse_held_volumes(sandbox_id, sbx)
            if sbx.base_ram is not None and sbx.machine.cfg.mem_path == sbx.base_ram and not sbx.machine.cfg.mem_share:
                return await self._snapshot_layered(sandbox_id, sbx, into)
            if sbx.volumes:
                raise StateError(f"cannot snapshot sandbox {sandbox_id}: a VM that owns its RAM is saved by migration, "
                                 "which QEMU refuses while volumes are mounted", sandbox_id=sandbox_id)
            return await self._snapshot_stream(sandbox_id, sbx, into)

    async def _refuse_held_volumes(self, sandbox_id: str, sbx: VmSandbox) -> None:
        """Conflict when a process of the running guest uses a volume mount: every restore of the
        snapshot would fail to mount it again (``VmSandbox.volume_holders``). A paused guest cannot
        be asked; its restores report it if so."""
        if not sbx.volumes or await sbx.machine.status() != "running":
            return
        spec = self.table.specs.get(sandbox_id)
        try:
            held = await sbx.volume_holders(spec.access_token if spec else None)
        except RuntimeFailure as exc:  # an image without ls/grep: its restores say so if it was in use
            log.warning("sandbox %s: %s; snapshotting without the check", sandbox_id, exc)
            return
        if held:
            raise Conflict(
                f"cannot snapshot or fork sandbox {sandbox_id}: its volumes are in use ({'; '.join(held)}). On vm a "
                "copy mounts its volumes again, and the guest cannot while a process holds a file or its working "
                "directory there: close those files (or cd elsewhere) and retry", sandbox_id=sandbox_id)

    async def _snapshot_layered(self, sandbox_id: str, sbx: VmSandbox, into: Path) -> SnapshotResult:
        """Full snapshot (processes, memory, files) of a VM on a frozen RAM file, paused only
        for a disk checkpoint, the device state and a read of the pages it changed
        (:mod:`memlayer`); the RAM itself is not streamed. Layer file, base RAM link and the
        disk flatten are written after the VM runs on."""
        tpl = await self.templates.by_key(sbx.template_key)
        assert sbx.base_ram is not None and sbx.ram_image is not None
        into.mkdir(parents=True, exist_ok=True)
        machine = sbx.machine
        was_running = await machine.status() == "running"
        steps: dict[str, float] = {}

        def read_ram() -> tuple[list[memlayer.Run], bytearray]:
            t1 = time.perf_counter()
            private = memlayer.read_private(machine.pid, machine.ram_mapping())
            steps["ram_ms"] = (time.perf_counter() - t1) * 1000
            return private

        frozen_top = sbx.disk_top()
        new_top = frozen_top.with_name(f"root.{sbx.disk_generation + 1}.qcow2")
        with translated(sandbox_id, "snapshot"):
            try:
                await asyncio.to_thread(disk.overlay_with_backing, tpl.empty_overlay, frozen_top, new_top)
                t0 = time.perf_counter()
                await machine.pause()
                # QMP first, then the RAM read: run side by side, the read's thread and the event loop
                # fight over the GIL and each QMP round trip took 10-25 ms instead of 2-4.
                steps["disk_ms"] = await machine.checkpoint_disk("root", new_top, prepared=True)
                sbx.disk_generation += 1
                steps["devices_ms"] = await machine.save_devices(into / DEVICE_STATE)
                # With the vCPUs stopped (and block I/O drained) nothing writes guest RAM.
                runs, pages = await asyncio.to_thread(read_ram)
            except BaseException:
                if sbx.disk_top() != new_top:
                    new_top.unlink(missing_ok=True)  # prepared, never put on top
                raise
            finally:
                await _resume_if(was_running, machine)
        paused_ms = (time.perf_counter() - t0) * 1000
        chain = list(sbx.mem_chain)
        if len(chain) + 1 > MEM_CHAIN_MAX or not all(p.is_file() for p in chain):
            chain = []  # compact: this snapshot's layer holds every private page
        names = [f"mem.{i}.layer" for i in range(len(chain) + 1)]
        base_ram, ram_image = sbx.base_ram, sbx.ram_image
        data: dict[str, Any] = {
            "template_key": tpl.key, "format": "layered", "ram_id": base_ram.name.removesuffix(".mem"),
            "mem_layers": names, "sandbox_id": sandbox_id, compat.RECORD: self._machine(), TEMPLATE_BUILD: tpl.ram_id,
        }  # fmt: skip

        def write_ram() -> None:
            own_runs, own = runs, pages
            if chain:
                parent = memlayer.page_map([memlayer.load(p) for p in chain])
                own_runs, own = memlayer.delta(runs, pages, parent, base_ram)
            for src, name in zip(chain, names, strict=False):
                link_or_copy(src, into / name)
            memlayer.save(into / names[-1], own_runs, own)
            data["ram_layer_bytes"] = len(own)
            link_or_copy(ram_image, into / BASE_RAM)

        async def write_files() -> None:
            # The VM runs on meanwhile; RAM layer and disk flatten are independent files.
            t1 = time.perf_counter()
            await asyncio.gather(
                asyncio.to_thread(write_ram), disk.flatten_onto(frozen_top, tpl.disk, into / SNAP_DISK)
            )
            steps["files_ms"] = (time.perf_counter() - t1) * 1000
            log.info(
                "sandbox %s: snapshot into %s (paused %.1f ms; %.1f MB private RAM in %d runs, %.1f MB new "
                "in layer %d; %s)", sandbox_id, into, paused_ms, len(pages) / 1e6, len(runs),
                data["ram_layer_bytes"] / 1e6, len(chain), ", ".join(f"{k} {v:.1f}" for k, v in steps.items()),
            )  # fmt: skip

        # The call returns now: the files follow while the sandbox runs (see SnapshotResult.pending).
        pending = self._finish_later(sandbox_id, into, write_files())
        spec = self.table.specs.get(sandbox_id)
        self.blank_pool.want(tpl.key, spec.allow_internet if spec else True)  # for its rollback or fork
        return SnapshotResult(
            mode=SnapshotMode.FULL, layers=(SNAP_DISK, DEVICE_STATE, *names, BASE_RAM),
            paused_ms=round(paused_ms, 1), data=data, pending=pending,
        )

    def _finish_later(self, sandbox_id: str, into: Path, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``work`` (writing a snapshot's files) in the background. While it runs, the snapshot
        dir holds UNFINISHED_MARKER (a restart discards such snapshots), restores of the snapshot
        wait for it (:meth:`_files_ready`), and so do a kill or rollback of the sandbox, whose
        disk chain it reads."""
        marker = into / UNFINISHED_MARKER
        marker.touch()

        async def run() -> None:
            try:
                await work
                marker.unlink()
            finally:
                self._finishing.pop(into, None)

        task = asyncio.create_task(run(), name=f"vm-snapshot-files-{into.name}")
        self._finishing[into] = (sandbox_id, task)
        return task

    async def _files_ready(self, snapshot: Path) -> None:
        """Until a snapshot's files are all written; raises if they never will be."""
        entry = self._finishing.get(snapshot)
        if entry is not None:
            try:
                await asyncio.shield(entry[1])
            except Exception as exc:
                raise RuntimeFailure(f"snapshot {snapshot.name}: its files could not be written: {exc}") from exc
        if (snapshot / UNFINISHED_MARKER).exists():
            raise RuntimeFailure(f"snapshot {snapshot.name} is incomplete: the server stopped while writing it")

    async def written(self, sandbox_id: str) -> None:
        """Until no snapshot of this sandbox is still reading its disk chain (before its kill)."""
        for task in [t for sid, t in self._finishing.values() if sid == sandbox_id]:
            with contextlib.suppress(BaseException):
                await asyncio.shield(task)

    async def drain(self) -> None:
        """Until every snapshot's files have landed (``VmRuntime.close``)."""
        for _, t in list(self._finishing.values()):
            with contextlib.suppress(BaseException):
                await asyncio.shield(t)

    async def _snapshot_stream(self, sandbox_id: str, sbx: VmSandbox, into: Path) -> SnapshotResult:
        """Full snapshot (device state + RAM + disk): a VM's memory is as cheap to save as
        its files, and a disk without the matching page cache is not safe to boot from a template
        RAM image. The sandbox is paused for the disk checkpoint and the RAM write (~0.5 s for a
        small guest under TCG), then continues."""
        tpl = await self.templates.by_key(sbx.template_key)
        into.mkdir(parents=True, exist_ok=True)
        was_running = await sbx.machine.status() == "running"
        t0 = time.perf_counter()
        with translated(sandbox_id, "snapshot"):
            try:
                await sbx.machine.pause()
                frozen_top = sbx.disk_top()
                new_top = frozen_top.with_name(f"root.{sbx.disk_generation + 1}.qcow2")
                await sbx.machine.checkpoint_disk("root", new_top)
                sbx.disk_generation += 1
                await sbx.machine.save_full(into / FULL_STATE)
            finally:
                await _resume_if(was_running, sbx.machine)
        paused_ms = (time.perf_counter() - t0) * 1000
        # The frozen chain no longer changes: flatten it onto the template disk while the VM runs.
        await disk.flatten_onto(frozen_top, tpl.disk, into / SNAP_DISK)
        log.info("sandbox %s: snapshot into %s (paused %.0f ms)", sandbox_id, into, paused_ms)
        return SnapshotResult(
            mode=SnapshotMode.FULL, layers=(SNAP_DISK, FULL_STATE), paused_ms=round(paused_ms),
            data={"template_key": tpl.key, TEMPLATE_BUILD: tpl.ram_id, compat.RECORD: self._machine()},
        )

    # -- restore --
    def check_machine(self, snapshot: Path, result: SnapshotResult) -> None:
        """``MachineMismatch`` when the snapshot records another machine than this host's (compat.py)."""
        compat.check(result.data, self._machine(), f"snapshot '{snapshot.name}'", snapshot_id=snapshot.name)

    async def check_restorable(self, snapshot: Path, result: SnapshotResult) -> None:
        """Refused before anything starts or ends: another machine (``check_machine``), or another build
        of the template. A vm snapshot's disk is a qcow2 layered on its template build's disk, and its RAM
        holds that disk's page cache; a template built again (on another node, or here after a rebuild)
        is another ext4 (mkfs picks new UUIDs and layouts), so restoring onto it would corrupt the disk."""
        self.check_machine(snapshot, result)
        key = str(result.data.get("template_key", ""))
        built = result.data.get(TEMPLATE_BUILD) or (result.data.get("ram_id") if result.data.get("format") == "layered"
                                                   else None)  # fmt: skip
        tpl = await self.templates.find(key)
        if built is not None and (tpl is None or tpl.ram_id != built):
            raise Conflict(
                f"snapshot '{snapshot.name}' was taken on another build of template {key} (another node, or this one "
                "before the template was built again): a vm snapshot runs only where its template build is "
                "(vm snapshots and pauses do not move between nodes yet)", snapshot_id=snapshot.name)

    async def create_from_snapshot(
        self, spec: SandboxSpec, snapshot: Path, result: SnapshotResult
    ) -> RuntimeState:
        return await self._restore_snapshot(spec, snapshot, result, init=True)

    async def _snapshot_overlay(self, snapshot: Path, run_dir: Path) -> None:
        """The sandbox's root overlay on the snapshot's disk: a copy of an empty overlay made once
        per snapshot (``qemu-img create`` is a process start, ~20 ms; a copy is ~0.1 ms)."""
        empty = snapshot / "empty.qcow2"
        async with self._overlay_locks.setdefault(snapshot, asyncio.Lock()):
            if not empty.is_file():
                await disk.create_overlay(snapshot / SNAP_DISK, empty)
        await asyncio.to_thread(disk.clone_overlay, empty, run_paths(run_dir)["root"])

    async def _restore_snapshot(
        self, spec: SandboxSpec, snapshot: Path, result: SnapshotResult, init: bool
    ) -> RuntimeState:
        """A new sandbox (ID, token, identity from ``spec``) resumed from a full snapshot.
        ``init=False``: the guest already has this identity (a rollback to a snapshot of the same
        sandbox); only clock and RNG are refreshed (the session's HELLO).

        Layered snapshot: a QEMU that maps the snapshot's base RAM ``share=off`` gets the
        snapshot's changed pages written into its private mapping, then loads the device state.
        Stream snapshot (older, or of a VM restored from a full save): a fresh RAM file filled by
        a classic migration."""
        await self._start()
        sid = spec.sandbox_id
        await self.check_restorable(snapshot, result)
        if sid in self.table.running:
            raise StateError(f"sandbox {sid} already exists", sandbox_id=sid)
        await self._files_ready(snapshot)
        key = str(result.data.get("template_key", ""))
        tpl = await self.templates.by_key(key)
        layered = result.data.get("format") == "layered"
        blank = None
        # A QEMU spawned ahead serves the template's empty export: one with volumes starts after its binds.
        share = await asyncio.to_thread(self.exports.prepare, spec) if self.exports is not None else None
        if layered and share is None and result.data.get("ram_id") == tpl.ram_id:
            blank = self.blank_pool.take(key, spec.allow_internet, refill=False)
        run_dir = blank.run_dir if blank is not None else self.run_root / sid
        if blank is None:
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True)
        sbx: VmSandbox | None = blank
        t0 = time.perf_counter()
        with translated(sid, "restore from snapshot", after="restore", also=(KeyError,)):
            try:
                if blank is not None:
                    blank.machine.set_nice(0)
                    if blank.machine.cfg.network == "user":
                        await netjail.reshape(sid, blank.machine.proc.pid)
                    if blank.machine.cfg.network == "user" and ENFORCER.has(sid):
                        # jailed under its pool name: the sandbox's policy before its guest runs
                        await ENFORCER.install(sid, blank.machine.proc.pid,
                                               await asyncio.to_thread(netjail.host_addresses), jail=True)
                    # Spawned ahead of time on the template's disk: re-point it at the snapshot's.
                    await asyncio.to_thread(disk.retarget_overlay, run_paths(run_dir)["root"], snapshot / SNAP_DISK)
                    await blank.machine.retarget_root("root", snapshot / SNAP_DISK)
                else:
                    await self._snapshot_overlay(snapshot, run_dir)
                base = child_config(tpl.cfg, sid, run_dir, spec.allow_internet, share)
                if layered:
                    ram = await self.templates.frozen_ram(str(result.data["ram_id"]), snapshot / BASE_RAM)
                    if sbx is None:
                        sbx = VmSandbox(sid, await spawn_on_frozen_ram(base, ram, run_dir), run_dir, key)
                    machine = sbx.machine
                    sbx.base_ram, sbx.ram_image = ram, snapshot / BASE_RAM
                    t1 = time.perf_counter()
                    layers = list(result.data.get("mem_layers") or [MEM_LAYER])
                    sbx.mem_chain = await asyncio.to_thread(_apply_layers, machine, snapshot, layers, run_dir)
                    machine.timings.extra["layers_ms"] = (time.perf_counter() - t1) * 1000
                    await machine.restore(snapshot / DEVICE_STATE)
                else:
                    machine = await spawn_on_own_ram(base, own_ram_file(self.shm_dir, sid), run_dir)
                    sbx = VmSandbox(sid, machine, run_dir, key)
                    await machine.restore(snapshot / FULL_STATE, ignore_shared=False)
                sbx.restored = True
                sbx.volumes = spec.volumes if share is not None else ()
                t_restored = time.perf_counter()
                if init:
                    await sbx.init_envd(spec, self.pids_limit)
                await sbx.check_volumes(spec.access_token)
            except BaseException:
                if sbx is not None:
                    await sbx.aclose()
                else:
                    shutil.rmtree(run_dir, ignore_errors=True)
                if share is not None and self.exports is not None:
                    await asyncio.to_thread(self.exports.release, sid)
                raise
        assert sbx is not None
        tm = sbx.machine.timings
        log.info(
            "sandbox %s: from snapshot %s in %.0f ms (restore %.0f: %s %.0f, layers %.0f, devices %.0f; "
            "envd init %s)", sid, snapshot.name, (time.perf_counter() - t0) * 1000, (t_restored - t0) * 1000,
            "spawned ahead" if blank is not None else "spawn", 0 if blank is not None else tm.spawn_ms or 0,
            tm.extra.get("layers_ms", 0), tm.restore_ms or 0,
            f"{(time.perf_counter() - t_restored) * 1000:.0f}" if init else "not needed",
        )  # fmt: skip
        self.table.add(sid, sbx, spec)
        if layered:
            self.blank_pool.want(key, spec.allow_internet)
        return self.table.state(sbx, spec)

    async def fork_mode(self, sandbox_id: str) -> SnapshotMode:
        """A VM snapshot always holds memory."""
        self.table.get(sandbox_id)  # unknown sandbox: SandboxNotFound, as for a snapshot
        return SnapshotMode.FULL

    async def rollback(
        self, sandbox_id: str, spec: SandboxSpec, snapshot: Path, result: SnapshotResult
    ) -> RuntimeState:
        """Same ID and token, state of ``snapshot``: end the current VM, restore the snapshot (refused
        first, the VM running on, when the snapshot is of another machine or template build)."""
        await self.check_restorable(snapshot, result)
        self.release.cancel(sandbox_id)
        await self.written(sandbox_id)
        old, rel, _ = self.table.remove(sandbox_id)
        if old is not None:
            await old.aclose()
        if rel is not None:
            await asyncio.to_thread(remove_dirs, rel.run_dir)
        same = result.data.get("sandbox_id") == sandbox_id  # its own snapshot: envd knows who it is
        return await self._restore_snapshot(spec, snapshot, result, init=not same)


async def _resume_if(was_running: bool, machine: Machine) -> None:
    """After a snapshot's pause: the VM runs on if it ran before (a paused sandbox stays paused)."""
    if was_running and machine.alive:
        with contextlib.suppress(MachineError):
            await machine.resume()


def _apply_layers(machine: Machine, snapshot: Path, names: list[str], run_dir: Path) -> list[Path]:
    """Write a snapshot's RAM layers, oldest first, into a waiting QEMU; link them into the run dir
    (the VM's parent chain for its own snapshots, kept even if the snapshot is deleted)."""
    memlayer.apply(machine.pid, machine.ram_mapping(), [snapshot / name for name in names])
    chain = [run_dir / f"mem.{i}.layer" for i in range(len(names))]
    for name, link in zip(names, chain, strict=True):
        link_or_copy(snapshot / name, link)
    return chain

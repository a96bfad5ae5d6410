"""``VmRuntime``: the Runtime protocol on QEMU microVMs that start by snapshot restore.

Create path::

    template shape known?  no → boot the template once, wait for envd, snapshot (template.py)
    pool hit  → a VM already restored from the template, envd answering (warm TCG cache)
    pool miss → spawn QEMU -incoming defer (~50 ms), migrate-incoming + cont (~20 ms)
    then      → POST /init to envd over the mux (env vars, token, identity)

Why the pool holds restored VMs and not just waiting processes: under TCG the first requests
through the guest's Python agent and envd after a restore cost ~600 ms of code translation
(scripts/vm/bench_restore.py), far more than QEMU start-up; a pre-restored VM has paid it.

Every hand-out, restore, fork and resume sends envd the host's wall time and fresh random bytes
(``/init`` ``hostTime``/``seed``): the guest sets its clock and reseeds its CRNG, so forks of one
snapshot never share random state. Pool entries also run a first command and file read before
they wait (``VmSandbox.warm_paths``), so TCG has translated those guest paths.

Pause is ``stop`` (vCPUs halt at once, memory kept); after ``vm_release_paused_after`` seconds
paused, the VM is saved fully into its run dir (``released.full``) and QEMU ends, so a long pause
holds no RAM; resume restores it into a new QEMU. Kill ends QEMU and removes the run dir.
Restart: ``adopt`` re-attaches to the recorded QEMU (pidfd + QMP) or, for a released sandbox,
finds its state file; ``reconcile`` kills and removes whatever under the run root nobody owns.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Coroutine
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from aenv.config import Settings
from aenv.errors import RuntimeFailure, SandboxNotFound, SandboxUnreachable, StateError
from aenv.mux import ByteStream, MuxError
from aenv.runtime.base import UNFINISHED_MARKER, ResourceSample, RuntimeState, SandboxSpec, SnapshotResult
from aenv.runtime.streams import open_checked

from . import disk, frozen, memlayer, netjail, pressure
from . import template as templates
from .accel import AccelChoice, choose_accel, qemu_binary
from .artifacts import GuestArtifacts, ensure
from .config import Accel, VmConfigError, accel_append, config_from_json
from .initramfs import BUSYBOX
from .kernel import SOURCE_TARBALL, find_kernel
from .machine import Machine, MachineError
from .pool import RestorePool
from .sandbox import VmSandbox, child_config, run_paths

log = logging.getLogger("aenv.runtime.vm")

OWNER_FILE = ".state-dir"
SNAP_DISK = "disk.qcow2"  # in a snapshot dir: the root disk, flattened onto the template disk
FULL_STATE = "vm.full"  # in a snapshot dir: device state + guest RAM (classic migration stream)
# A layered snapshot (the default for a VM on a frozen RAM file): no RAM stream, but
DEVICE_STATE = "devices.state"  # device + vCPU state (xen-save-devices-state, ~60 KB)
MEM_LAYER = "mem.layer"  # the pages the VM changed against its base RAM (memlayer)
# A snapshot of a VM restored from a snapshot stores mem.<n>.layer: only its changes against the
# parent's layers (linked in as mem.0 ... mem.<n-1>). At this depth it stores all its pages in one
# layer again (compaction): deeper chains cost every restore one more file to read and apply.
MEM_CHAIN_MAX = 8
POOL_NICE = 10  # CPU priority of pool entries until handed out
SPARE_STREAMS = 2  # envd streams a pool entry opens ahead: one for the create's /init, one for the client
BASE_RAM = "base.ram"  # that base RAM (hard link of the template's ram.img: stored once)
RELEASED_STATE = "released.full"  # in a run dir: a paused sandbox saved to disk, its QEMU ended
# A released VM on a frozen base RAM is saved layered instead: device state, changed pages, a link
# of the base RAM image, and last this marker (JSON: which base RAM), whose presence means released.
RELEASED_LAYERED = "released.json"
_RELEASED_FILES = ("released.devices", "released.layer", "released.base")




def unavailable_reason(settings: Settings) -> str | None:
    """None when this runtime can run here, else why not (``--runtime auto`` and ``aenv doctor``)."""
    if qemu_binary() is None:
        return "qemu-system-x86_64 not installed (apt-get install qemu-system-x86 qemu-utils)"
    if shutil.which("qemu-img") is None or shutil.which("mkfs.ext4") is None:
        return "qemu-img or mkfs.ext4 missing (apt-get install qemu-utils e2fsprogs)"
    if not BUSYBOX.is_file():
        return "static busybox missing (apt-get install busybox-static)"
    if not Path("/dev/shm").is_dir():
        return "/dev/shm missing"
    if find_kernel(settings.cache_dir) is None and not SOURCE_TARBALL.is_file():
        return "no guest kernel and no linux-source-6.1 to build one"
    return None


@dataclass(frozen=True)
class Released:
    """A paused sandbox whose VM was saved to ``run_dir/released.full`` and ended: no process, no
    RAM; its disk overlays stay in ``run_dir``. ``resume`` restores it into a new QEMU."""

    name: str
    run_dir: Path
    template_key: str
    disk_generation: int
    allow_internet: bool

    @property
    def state_file(self) -> Path:
        return self.run_dir / RELEASED_STATE

    @property
    def marker(self) -> Path:
        return self.run_dir / RELEASED_LAYERED

    def files(self) -> list[Path]:
        return [self.state_file, self.marker, *(self.run_dir / n for n in _RELEASED_FILES)]

    def state(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "run_dir": str(self.run_dir),
            "template_key": self.template_key,
            "released": str(self.state_file),
            "disk_generation": self.disk_generation,
        }


def is_released(run_dir: Path) -> bool:
    """A complete saved state (stream or layered marker) is in ``run_dir``."""
    return (run_dir / RELEASED_STATE).is_file() or (run_dir / RELEASED_LAYERED).is_file()


def _disk_generation(run_dir: Path) -> int:
    """Highest N of the root.N.qcow2 overlays that snapshots stacked in a run dir (0: none)."""
    gens = [int(p.name.split(".")[1]) for p in run_dir.glob("root.*.qcow2") if p.name.split(".")[1].isdigit()]
    return max(gens, default=0)


class VmRuntime:
    name = "vm"

    def __init__(
        self,
        settings: Settings,
        pool_size: int | None = None,
        *,
        tools_dir: Path | None = None,
        artifacts: GuestArtifacts | None = None,
        force_accel: Accel | None = None,
        shm_dir: Path | None = None,
        boot_timeout: float = 180.0,
        run_root: Path | None = None,
        warm_timeout: float = 60.0,
    ) -> None:
        self.settings = settings
        self.pool_size = settings.pool_size if pool_size is None else pool_size
        self.tools_dir = tools_dir
        self.artifacts = artifacts
        self.force_accel = force_accel
        # Template RAM files: per state dir, so two servers (or test runs) never share or clobber them.
        self.shm_dir = shm_dir or shm_dir_for(settings.state_dir)
        # Template RAM files, mapped share=off by every sandbox: a ramfs, so none can punch them.
        self.frozen_dir = self.shm_dir / "frozen"
        self.boot_timeout = boot_timeout
        self.warm_timeout = warm_timeout
        self.vm_dir = settings.state_dir / "vm"
        self.templates_dir = self.vm_dir / "templates"
        self.run_root = run_root or _short_run_root(self.vm_dir / "run")
        self.accel: AccelChoice | None = None
        self.guest_append: tuple[str, ...] = ()  # accelerator-specific kernel words, set by start()
        self.pool = RestorePool(self.pool_size, self._spawn_warm)
        # QEMU processes spawned for a template and left waiting (not restored): a snapshot of that
        # template restores into one, its disk re-pointed (rollback, fork, create from snapshot).
        self.blank_pool = RestorePool(self.pool_size, self._spawn_blank)
        self._templates: dict[str, templates.FrozenTemplate] = {}
        self._template_locks: dict[str, asyncio.Lock] = {}
        self._sandboxes: dict[str, VmSandbox] = {}
        self._building: set[str] = set()  # boot dir names of template builds in flight
        self._specs: dict[str, SandboxSpec] = {}
        self._start_lock = asyncio.Lock()
        self._started = False
        self.release_after = settings.vm_release_paused_after
        self.memory_low_mb = settings.vm_memory_low_mb  # see pressure.py
        self.pressure_interval = 1.0
        self._paused_since: dict[str, float] = {}  # paused and still in RAM: when it was paused
        self._pressure_task: asyncio.Task[None] | None = None
        self._released: dict[str, Released] = {}
        self._release_tasks: dict[str, asyncio.Task[None]] = {}
        self._locks: dict[str, asyncio.Lock] = {}  # per sandbox: pause/resume/release/kill
        self._overlay_locks: dict[Path, asyncio.Lock] = {}  # per snapshot dir: its empty overlay
        # Snapshot files still being written after the call returned: per snapshot dir, the
        # sandbox whose disk chain the task reads (its kill or rollback must wait) and the task.
        self._finishing: dict[Path, tuple[str, asyncio.Task[None]]] = {}

    # ---- host-wide lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        async with self._start_lock:
            if self._started:
                return
            self.accel = choose_accel(force=self.force_accel)
            self.guest_append = accel_append(self.accel.accel, self.settings.vm_guest_aslr)
            log.info(
                "vm runtime: accelerator %s (%s); guest kernel words %s",
                self.accel.accel, self.accel.reason, " ".join(self.guest_append) or "(defaults)",
            )  # fmt: skip
            if self.artifacts is None:
                if self.tools_dir is None:
                    from aenv.runtime.tools import ensure_tools

                    self.tools_dir = await asyncio.to_thread(ensure_tools, self.settings)
                self.artifacts = await ensure(self.settings.cache_dir, self.tools_dir)
            for d in (self.templates_dir, self.run_root, self.shm_dir):
                d.mkdir(parents=True, exist_ok=True)
            (self.shm_dir / OWNER_FILE).write_text(str(self.settings.state_dir))
            await asyncio.to_thread(sweep_orphan_ram, self.shm_dir.parent)
            await asyncio.to_thread(frozen.ensure, self.frozen_dir)
            if self.memory_low_mb > 0:
                self._pressure_task = asyncio.create_task(self._watch_pressure(), name="vm-memory-pressure")
            self._started = True

    async def close(self) -> None:
        """Kill pooled processes and drop channels; handed-out sandboxes keep running."""
        if self._pressure_task is not None:
            self._pressure_task.cancel()
            with contextlib.suppress(BaseException):
                await self._pressure_task
            self._pressure_task = None
        for t in list(self._release_tasks.values()):
            t.cancel()
        for t in list(self._release_tasks.values()):
            with contextlib.suppress(BaseException):
                await t
        self._release_tasks.clear()
        for _, t in list(self._finishing.values()):  # snapshot files: ~10-100 ms, let them land
            with contextlib.suppress(BaseException):
                await asyncio.shield(t)
        await self.pool.aclose()
        await self.blank_pool.aclose()
        for sbx in self._sandboxes.values():
            await sbx.drop_session()

    # ---- templates ------------------------------------------------------------------------------
    def _shape(self, spec: SandboxSpec) -> templates.Shape:
        return templates.Shape(spec.cpu_count, spec.memory_mb, spec.disk_mb)

    async def template_for(self, spec: SandboxSpec) -> templates.FrozenTemplate:
        """The snapshot for this template and shape, built on first use (one build per key)."""
        await self.start()
        assert self.accel is not None and self.artifacts is not None
        key = templates.template_key(spec.template, self._shape(spec), self.accel, self.artifacts, self.guest_append)
        if (tpl := self._templates.get(key)) is not None:
            return tpl
        lock = self._template_locks.setdefault(key, asyncio.Lock())
        async with lock:
            if (tpl := self._templates.get(key)) is not None:
                return tpl
            tpl = await asyncio.to_thread(templates.load, self.templates_dir, key)
            if tpl is not None and tpl.mem_path.parent != self.frozen_dir:
                log.warning("template %s: RAM file %s not in the frozen store; rebuilding", key, tpl.mem_path)
                tpl = None
            if tpl is not None:
                await self._frozen_ram(tpl.ram_id, tpl.ram_image)  # back from disk after a reboot
            if tpl is None:
                boot_name = templates.boot_dir_name(key)
                self._building.add(boot_name)
                try:
                    tpl = await templates.build(
                        self.templates_dir,
                        spec.template,
                        self._shape(spec),
                        self.accel,
                        self.artifacts,
                        boot_timeout=self.boot_timeout,
                        shm_dir=self.frozen_dir,
                        run_root=self.run_root,
                        append=self.guest_append,
                    )
                finally:
                    self._building.discard(boot_name)  # fmt: skip
            self._templates[key] = tpl
            return tpl

    async def _spawn_blank(self, name: str, template_key: str, allow_internet: bool) -> VmSandbox:
        """A QEMU process waiting for the device state of a layered snapshot of this template
        (``xen-save-devices-state`` streams have no configuration section)."""
        sbx = await self._spawn_restore(name, template_key, allow_internet, send_configuration=False)
        sbx.machine.set_nice(POOL_NICE)
        return sbx

    async def _spawn_restore(
        self, name: str, template_key: str, allow_internet: bool, send_configuration: bool = True
    ) -> VmSandbox:
        """A QEMU process waiting for this template's device state (not yet restored)."""
        tpl = self._templates[template_key]
        run_dir = self.run_root / name
        run_dir.mkdir(parents=True)
        try:
            p = run_paths(run_dir)
            await asyncio.to_thread(disk.clone_overlay, tpl.empty_overlay, p["root"])
            cfg = replace(child_config(tpl.cfg, name, run_dir, allow_internet), send_configuration=send_configuration)
            machine = await Machine.spawn(cfg, stderr_path=p["stderr"])
        except BaseException:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise
        sbx = VmSandbox(name, machine, run_dir, template_key)
        sbx.base_ram, sbx.ram_image = tpl.mem_path, tpl.ram_image
        return sbx

    async def _frozen_ram(self, ram_id: str, image: Path) -> Path:
        """The frozen RAM file ``ram_id`` in the store, copied from its on-disk ``image`` when the
        store lacks it (a reboot emptied /dev/shm, or a snapshot from another machine)."""
        mem = self.frozen_dir / f"{ram_id}.mem"
        if not mem.is_file():
            if not image.is_file():
                raise RuntimeFailure(f"RAM {ram_id}: neither in the frozen store nor on disk ({image})")
            t0 = time.perf_counter()
            n = await asyncio.to_thread(frozen.copy_sparse, image, mem)
            log.info("vm: RAM %s back in the frozen store (%.0f MB in %.0f ms)", ram_id, n / 1e6,
                     (time.perf_counter() - t0) * 1000)  # fmt: skip
        return mem

    async def _spawn_warm(self, name: str, template_key: str, allow_internet: bool) -> VmSandbox:
        """A pool entry: restored, resumed and with envd answering, so that a create only has to
        send ``/init``. Under TCG this matters most: a fresh QEMU has an empty translation cache,
        and the first requests through agent and envd (Python) cost several hundred ms."""
        tpl = self._templates[template_key]
        sbx = await self._spawn_restore(name, template_key, allow_internet)
        sbx.machine.set_nice(POOL_NICE)  # its warm-up yields to sandboxes in use
        try:
            await sbx.machine.restore(tpl.device_state)
            await sbx.wait_envd(self.warm_timeout)
            await sbx.warm_paths()
            await sbx.open_spares(SPARE_STREAMS)
        except BaseException:
            await sbx.aclose()
            raise
        sbx.restored = True
        return sbx

    # ---- Runtime protocol -----------------------------------------------------------------------
    async def create(self, spec: SandboxSpec) -> RuntimeState:
        sid = spec.sandbox_id
        if sid in self._sandboxes:
            raise StateError(f"sandbox {sid} already exists", sandbox_id=sid)
        try:
            tpl = await self.template_for(spec)
        except Exception as exc:
            raise RuntimeFailure(f"sandbox {sid}: template: {exc}", sandbox_id=sid) from exc
        sbx: VmSandbox | None = self.pool.take(tpl.key, spec.allow_internet)
        t0 = time.perf_counter()
        if sbx is not None:
            sbx.machine.set_nice(0)
        try:
            if sbx is None:
                sbx = await self._spawn_restore(sid, tpl.key, spec.allow_internet)
            if not sbx.restored:
                await sbx.machine.restore(tpl.device_state)
                sbx.restored = True
            t_restored = time.perf_counter()
            await sbx.init_envd(spec, self.settings.pids_limit)
        except BaseException as exc:
            if sbx is not None:
                await sbx.aclose(extra_dir=spec.workdir)
            if isinstance(exc, (MuxError, OSError, TimeoutError)):
                raise SandboxUnreachable(
                    f"sandbox {sid}: envd unreachable after restore: {exc}", sandbox_id=sid
                ) from exc
            if isinstance(exc, MachineError):
                raise RuntimeFailure(f"sandbox {sid}: restore failed: {exc}", sandbox_id=sid) from exc
            raise
        t_end = time.perf_counter()
        sbx.machine.timings.extra.update(
            create_ms=(t_end - t0) * 1000,
            restore_ms=(t_restored - t0) * 1000,
            init_ms=(t_end - t_restored) * 1000,
        )
        log.info(
            "sandbox %s: from %s in %.1f ms (restore %.1f, envd init %.1f)",
            sid, tpl.key, (t_end - t0) * 1000, (t_restored - t0) * 1000, (t_end - t_restored) * 1000,
        )  # fmt: skip
        self._sandboxes[sid] = sbx
        self._specs[sid] = spec
        return self._state(sbx, spec)

    # ---- snapshots, fork, rollback (SnapshotCapable) -----------------------------------------------
    async def _template_by_key(self, key: str) -> templates.FrozenTemplate:
        tpl = self._templates.get(key)
        if tpl is None:
            tpl = await asyncio.to_thread(templates.load, self.templates_dir, key)
            if tpl is None:
                raise RuntimeFailure(f"template snapshot {key} is gone (RAM file or disk missing)")
            self._templates[key] = tpl
        return tpl

    async def snapshot(self, sandbox_id: str, into: Path, mode: str) -> SnapshotResult:
        async with self._lock(sandbox_id):  # no release to disk in the middle of a snapshot
            return await self._snapshot_locked(sandbox_id, into, mode)

    async def _snapshot_locked(self, sandbox_id: str, into: Path, mode: str) -> SnapshotResult:
        await self.start()
        sbx = await self._loaded_locked(sandbox_id)
        if sbx.base_ram is not None and sbx.machine.cfg.mem_path == sbx.base_ram and not sbx.machine.cfg.mem_share:
            return await self._snapshot_layered(sandbox_id, sbx, into)
        return await self._snapshot_stream(sandbox_id, into)

    async def _snapshot_layered(self, sandbox_id: str, sbx: VmSandbox, into: Path) -> SnapshotResult:
        """Full snapshot (processes, memory, files) of a VM on a frozen RAM file, paused only
        for a disk checkpoint, the device state and a read of the pages it changed
        (:mod:`memlayer`); the RAM itself is not streamed. Layer file, base RAM link and the
        disk flatten are written after the VM runs on."""
        tpl = await self._template_by_key(sbx.template_key)
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
        except (MachineError, memlayer.LayerError, disk.DiskError, OSError) as exc:
            if sbx.disk_top() != new_top:
                new_top.unlink(missing_ok=True)  # prepared, never put on top
            raise RuntimeFailure(f"sandbox {sandbox_id}: snapshot failed: {exc}", sandbox_id=sandbox_id) from exc
        finally:
            if was_running and machine.alive:
                with contextlib.suppress(MachineError):
                    await machine.resume()
        paused_ms = (time.perf_counter() - t0) * 1000
        chain = list(sbx.mem_chain)
        if len(chain) + 1 > MEM_CHAIN_MAX or not all(p.is_file() for p in chain):
            chain = []  # compact: this snapshot's layer holds every private page
        names = [f"mem.{i}.layer" for i in range(len(chain) + 1)]
        base_ram, ram_image = sbx.base_ram, sbx.ram_image
        data: dict[str, Any] = {
            "template_key": tpl.key, "format": "layered", "ram_id": base_ram.name.removesuffix(".mem"),
            "mem_layers": names, "paused_ms": round(paused_ms, 1), "sandbox_id": sandbox_id,
        }  # fmt: skip

        def write_ram() -> None:
            own_runs, own = runs, pages
            if chain:
                parent = memlayer.page_map([memlayer.load(p) for p in chain])
                own_runs, own = memlayer.delta(runs, pages, parent, base_ram)
            for src, name in zip(chain, names, strict=False):
                _link_or_copy(src, into / name)
            memlayer.save(into / names[-1], own_runs, own)
            data["ram_layer_bytes"] = len(own)
            _link_or_copy(ram_image, into / BASE_RAM)

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
        spec = self._specs.get(sandbox_id)
        self.blank_pool.want(tpl.key, spec.allow_internet if spec else True)  # for its rollback or fork
        return SnapshotResult(
            mode="full", layers=(SNAP_DISK, DEVICE_STATE, *names, BASE_RAM), data=data, pending=pending
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

    async def _snapshots_written(self, sandbox_id: str) -> None:
        """Until no snapshot of this sandbox is still reading its disk chain."""
        for task in [t for sid, t in self._finishing.values() if sid == sandbox_id]:
            with contextlib.suppress(BaseException):
                await asyncio.shield(task)

    async def _snapshot_stream(self, sandbox_id: str, into: Path) -> SnapshotResult:
        """Full snapshot (device state + RAM + disk): a VM's memory is as cheap to save as
        its files, and a disk without the matching page cache is not safe to boot from a template
        RAM image. The sandbox is paused for the disk checkpoint and the RAM write (~0.5 s for a
        small guest under TCG), then continues."""
        await self.start()
        sbx = await self._loaded_locked(sandbox_id)
        tpl = await self._template_by_key(sbx.template_key)
        into.mkdir(parents=True, exist_ok=True)
        was_running = await sbx.machine.status() == "running"
        t0 = time.perf_counter()
        try:
            await sbx.machine.pause()
            frozen_top = sbx.disk_top()
            new_top = frozen_top.with_name(f"root.{sbx.disk_generation + 1}.qcow2")
            await sbx.machine.checkpoint_disk("root", new_top)
            sbx.disk_generation += 1
            await sbx.machine.save_full(into / FULL_STATE)
        except MachineError as exc:
            raise RuntimeFailure(
                f"sandbox {sandbox_id}: snapshot failed: {exc}", sandbox_id=sandbox_id
            ) from exc
        finally:
            if was_running and sbx.machine.alive:
                with contextlib.suppress(MachineError):
                    await sbx.machine.resume()
        paused_ms = (time.perf_counter() - t0) * 1000
        # The frozen chain no longer changes: flatten it onto the template disk while the VM runs.
        await disk.flatten_onto(frozen_top, tpl.disk, into / SNAP_DISK)
        log.info("sandbox %s: snapshot into %s (paused %.0f ms)", sandbox_id, into, paused_ms)
        return SnapshotResult(
            mode="full",
            layers=(SNAP_DISK, FULL_STATE),
            data={"template_key": tpl.key, "paused_ms": round(paused_ms)},
        )

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
        await self.start()
        sid = spec.sandbox_id
        if sid in self._sandboxes:
            raise StateError(f"sandbox {sid} already exists", sandbox_id=sid)
        await self._files_ready(snapshot)
        key = str(result.data.get("template_key", ""))
        tpl = await self._template_by_key(key)
        layered = result.data.get("format") == "layered"
        blank = None
        if layered and result.data.get("ram_id") == tpl.ram_id:
            blank = self.blank_pool.take(key, spec.allow_internet, refill=False)
        run_dir = blank.run_dir if blank is not None else self.run_root / sid
        if blank is None:
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True)
        sbx: VmSandbox | None = blank
        t0 = time.perf_counter()
        try:
            if blank is not None:
                blank.machine.set_nice(0)
                # Spawned ahead of time on the template's disk: re-point it at the snapshot's.
                await asyncio.to_thread(disk.retarget_overlay, run_paths(run_dir)["root"], snapshot / SNAP_DISK)
                await blank.machine.retarget_root("root", snapshot / SNAP_DISK)
            else:
                await self._snapshot_overlay(snapshot, run_dir)
            base = child_config(tpl.cfg, sid, run_dir, spec.allow_internet)
            if layered:
                ram = await self._frozen_ram(str(result.data["ram_id"]), snapshot / BASE_RAM)
                if blank is not None:
                    machine = blank.machine
                else:
                    cfg = replace(base, mem_path=ram, send_configuration=False)
                    machine = await Machine.spawn(cfg, stderr_path=run_paths(run_dir)["stderr"])
                    sbx = VmSandbox(sid, machine, run_dir, key)
                assert sbx is not None
                sbx.base_ram, sbx.ram_image = ram, snapshot / BASE_RAM
                t1 = time.perf_counter()
                sbx.mem_chain = await asyncio.to_thread(
                    _apply_layers, machine, snapshot, list(result.data.get("mem_layers") or [MEM_LAYER]), run_dir
                )
                machine.timings.extra["layers_ms"] = (time.perf_counter() - t1) * 1000
                await machine.restore(snapshot / DEVICE_STATE)
            else:
                # Fresh, empty RAM file: a full migration skips zero pages, so the target must read
                # as zeros (never map the template file here).
                mem = self.shm_dir / f"sbx-{sid}.mem"
                with contextlib.suppress(FileNotFoundError):
                    mem.unlink()
                cfg = replace(base, mem_share=True, mem_path=mem)
                machine = await Machine.spawn(cfg, stderr_path=run_paths(run_dir)["stderr"], owned=[mem])
                sbx = VmSandbox(sid, machine, run_dir, key)
                await machine.restore(snapshot / FULL_STATE, ignore_shared=False)
            sbx.restored = True
            t_restored = time.perf_counter()
            if init:
                await sbx.init_envd(spec, self.settings.pids_limit)
        except BaseException as exc:
            if sbx is not None:
                await sbx.aclose()
            else:
                shutil.rmtree(run_dir, ignore_errors=True)
            if isinstance(exc, (MachineError, disk.DiskError, memlayer.LayerError, KeyError)):
                raise RuntimeFailure(
                    f"sandbox {sid}: restore from snapshot failed: {exc}", sandbox_id=sid
                ) from exc
            if isinstance(exc, (MuxError, OSError)):
                raise SandboxUnreachable(
                    f"sandbox {sid}: envd unreachable after restore: {exc}", sandbox_id=sid
                ) from exc
            raise
        tm = sbx.machine.timings
        log.info(
            "sandbox %s: from snapshot %s in %.0f ms (restore %.0f: %s %.0f, layers %.0f, devices %.0f; "
            "envd init %s)", sid, snapshot.name, (time.perf_counter() - t0) * 1000, (t_restored - t0) * 1000,
            "spawned ahead" if blank is not None else "spawn", 0 if blank is not None else tm.spawn_ms or 0,
            tm.extra.get("layers_ms", 0), tm.restore_ms or 0,
            f"{(time.perf_counter() - t_restored) * 1000:.0f}" if init else "not needed",
        )  # fmt: skip
        self._sandboxes[sid] = sbx
        self._specs[sid] = spec
        if layered:
            self.blank_pool.want(key, spec.allow_internet)
        return self._state(sbx, spec)

    async def fork(
        self, sandbox_id: str, children: list[SandboxSpec], scratch: Path
    ) -> tuple[SnapshotResult, list[RuntimeState | BaseException]]:
        """Snapshot the source into ``scratch`` (it keeps running), then restore every child from it."""
        result = await self.snapshot(sandbox_id, scratch, "full")
        states = await asyncio.gather(
            *(self.create_from_snapshot(c, scratch, result) for c in children), return_exceptions=True
        )
        return result, list(states)

    async def rollback(
        self, sandbox_id: str, spec: SandboxSpec, snapshot: Path, result: SnapshotResult
    ) -> RuntimeState:
        """Same ID and token, state of ``snapshot``: end the current VM, restore the snapshot."""
        self._cancel_release(sandbox_id)
        await self._snapshots_written(sandbox_id)
        old = self._sandboxes.pop(sandbox_id, None)
        self._specs.pop(sandbox_id, None)
        if old is not None:
            await old.aclose()
        rel = self._released.pop(sandbox_id, None)
        if rel is not None:
            await asyncio.to_thread(_rm_dirs, rel.run_dir)
        same = result.data.get("sandbox_id") == sandbox_id  # its own snapshot: envd knows who it is
        return await self._restore_snapshot(spec, snapshot, result, init=not same)

    def _state(self, sbx: VmSandbox, spec: SandboxSpec | None) -> RuntimeState:
        data = sbx.state()
        data["workdir"] = str(spec.workdir) if spec else None
        return RuntimeState(data=data)

    def _get(self, sandbox_id: str) -> VmSandbox:
        sbx = self._sandboxes.get(sandbox_id)
        if sbx is None:
            raise SandboxNotFound(sandbox_id)
        return sbx

    async def open_stream(self, sandbox_id: str, port: int) -> ByteStream:
        sbx = self._get(sandbox_id)
        return await open_checked(
            sandbox_id, port, sbx.open_stream, lambda: sbx.machine.alive, channel_errors=(MachineError,)
        )

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    def _state_any(self, sandbox_id: str) -> RuntimeState:
        rel = self._released.get(sandbox_id)
        if rel is not None:
            data = rel.state()
            spec = self._specs.get(sandbox_id)
            data["workdir"] = str(spec.workdir) if spec else None
            return RuntimeState(data=data)
        return self._state(self._get(sandbox_id), self._specs.get(sandbox_id))

    async def pause(self, sandbox_id: str) -> RuntimeState:
        """``stop`` at once (vCPUs halt, memory kept); after ``vm_release_paused_after`` seconds
        still paused, the VM is saved to disk and QEMU ends (0: before this returns)."""
        async with self._lock(sandbox_id):
            if sandbox_id in self._released:
                return self._state_any(sandbox_id)
            sbx = self._get(sandbox_id)
            try:
                # Streams end, the channel stays (VmSandbox.quiesce); envd keeps processes whose
                # client went away.
                sbx.quiesce()
                await sbx.machine.pause()
                if self.release_after <= 0:
                    await self._release_locked(sandbox_id)
            except MachineError as exc:
                raise RuntimeFailure(
                    f"sandbox {sandbox_id}: pause failed: {exc}", sandbox_id=sandbox_id
                ) from exc
            if self.release_after > 0:
                self._schedule_release(sandbox_id)
            return self._state_any(sandbox_id)

    def _schedule_release(self, sandbox_id: str) -> None:
        """A paused VM in RAM: released after ``release_after`` s, or earlier under memory pressure."""
        self._cancel_release(sandbox_id)
        self._paused_since[sandbox_id] = time.monotonic()
        self._release_tasks[sandbox_id] = asyncio.create_task(
            self._release_later(sandbox_id), name=f"vm-release-{sandbox_id}"
        )

    def _cancel_release(self, sandbox_id: str) -> None:
        self._paused_since.pop(sandbox_id, None)
        task = self._release_tasks.pop(sandbox_id, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def _release_later(self, sandbox_id: str) -> None:
        await asyncio.sleep(self.release_after)
        async with self._lock(sandbox_id):
            if self._release_tasks.get(sandbox_id) is not asyncio.current_task():
                return  # resumed, killed or re-paused meanwhile
            self._release_tasks.pop(sandbox_id, None)
            if not await self._release_if_paused(sandbox_id):
                self._paused_since.pop(sandbox_id, None)  # not a paused VM in RAM any more

    async def _release_if_paused(self, sandbox_id: str) -> bool:
        """Release ``sandbox_id`` if it is still a stopped VM in RAM (lock held). Failures are logged:
        the VM then simply stays paused in RAM."""
        sbx = self._sandboxes.get(sandbox_id)
        try:
            if sbx is None or await sbx.machine.status() not in ("paused", "postmigrate"):
                return False
            await self._release_locked(sandbox_id)
            return True
        except (MachineError, OSError) as exc:
            log.warning("sandbox %s: could not release paused VM memory: %s", sandbox_id, exc)
            return False

    async def _watch_pressure(self) -> None:
        """Every ``pressure_interval`` s: while the host is below ``vm_memory_low_mb`` available,
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
            async with self._lock(sandbox_id):
                if sandbox_id not in self._paused_since:
                    continue  # resumed or killed meanwhile
                self._cancel_release(sandbox_id)
                if await self._release_if_paused(sandbox_id):
                    released.append(sandbox_id)
                    log.info("sandbox %s: released under memory pressure (%.0f MB available, mark %.0f MB)",
                             sandbox_id, available or 0, self.memory_low_mb)
        return released

    async def _release_locked(self, sandbox_id: str) -> None:
        """Save the (stopped) VM fully to its run dir and end QEMU; disk overlays stay. The state
        file is renamed into place only when complete, so its presence means "released"."""
        sbx = self._get(sandbox_id)
        spec = self._specs.get(sandbox_id)
        rel = Released(
            sbx.name, sbx.run_dir, sbx.template_key, sbx.disk_generation,
            spec.allow_internet if spec else sbx.machine.cfg.network == "user",
        )  # fmt: skip
        t0 = time.perf_counter()
        if sbx.base_ram is not None and sbx.ram_image is not None and not sbx.machine.cfg.mem_share:
            size = await self._save_layered(sbx, rel)
        else:
            await sbx.machine.save_full(rel.state_file)
            size = rel.state_file.stat().st_size
        t_saved = time.perf_counter()
        await sbx.drop_session()
        await sbx.machine.kill(keep=[*sbx.run_dir.glob("root*.qcow2"), *(p for p in rel.files() if p.exists())])
        self._sandboxes.pop(sandbox_id, None)
        self._paused_since.pop(sandbox_id, None)
        self._released[sandbox_id] = rel
        log.info(
            "sandbox %s: paused VM released to disk (%.1f MB saved in %.0f ms, QEMU ended in %.0f ms)",
            sandbox_id, size / 1e6, (t_saved - t0) * 1000, (time.perf_counter() - t_saved) * 1000,
        )  # fmt: skip

    async def _save_layered(self, sbx: VmSandbox, rel: Released) -> int:
        """The stopped VM as device state + changed pages (+ its base RAM image, linked), the
        marker last; returns the bytes written. A few MB instead of all touched RAM."""
        assert sbx.base_ram is not None and sbx.ram_image is not None
        machine = sbx.machine
        devices, layer, base = (rel.run_dir / n for n in _RELEASED_FILES)
        await machine.save_devices(devices)

        def write() -> int:
            size = memlayer.save(layer, *memlayer.read_private(machine.pid, machine.ram_mapping()))
            _link_or_copy(sbx.ram_image, base)  # type: ignore[arg-type]
            tmp = rel.marker.with_name(f".{rel.marker.name}.tmp")
            marker = {"ram_id": sbx.base_ram.name.removesuffix(".mem"), "mem_chain": [p.name for p in sbx.mem_chain]}  # type: ignore[union-attr]
            tmp.write_text(json.dumps(marker))
            os.rename(tmp, rel.marker)
            return size + devices.stat().st_size

        return await asyncio.to_thread(write)

    async def _load_released(self, sandbox_id: str, run: bool) -> VmSandbox:
        """A new QEMU from a released sandbox's state file, paused (``run=False``) or running.
        The state file is removed only once the VM is back; on failure it stays released."""
        rel = self._released[sandbox_id]
        tpl = await self._template_by_key(rel.template_key)
        top = run_paths(rel.run_dir)["root"]
        if rel.disk_generation:
            top = top.with_name(f"root.{rel.disk_generation}.qcow2")
        base = child_config(tpl.cfg, rel.name, rel.run_dir, rel.allow_internet)
        drives = tuple(
            replace(d, path=top) if d.serial == "root" else d for d in base.drives
        )
        t0 = time.perf_counter()
        keep = [*rel.run_dir.glob("root*.qcow2"), *(p for p in rel.files() if p.exists())]
        if rel.marker.is_file():
            devices, layer, base_image = (rel.run_dir / n for n in _RELEASED_FILES)
            marker = json.loads(rel.marker.read_text())
            ram_id = str(marker["ram_id"])
            ram = await self._frozen_ram(ram_id, base_image)
            cfg = replace(base, mem_path=ram, send_configuration=False, drives=drives)
            machine = await Machine.spawn(cfg, stderr_path=run_paths(rel.run_dir)["stderr"])
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
            mem = self.shm_dir / f"sbx-{sandbox_id}.mem"
            with contextlib.suppress(FileNotFoundError):
                mem.unlink()  # a full migration skips zero pages: the target RAM must read as zeros
            cfg = replace(base, mem_share=True, mem_path=mem, drives=drives)
            machine = await Machine.spawn(cfg, stderr_path=run_paths(rel.run_dir)["stderr"], owned=[mem])
            try:
                await machine.restore(rel.state_file, resume=run, ignore_shared=False)
            except BaseException:
                await machine.kill(keep=keep)
                raise
            sbx = VmSandbox(rel.name, machine, rel.run_dir, rel.template_key)
        sbx.restored = True
        sbx.disk_generation = rel.disk_generation
        self._sandboxes[sandbox_id] = sbx
        del self._released[sandbox_id]
        for p in rel.files():
            if p.name != "released.base":
                p.unlink(missing_ok=True)
        log.info("sandbox %s: restored from disk in %.0f ms", sandbox_id, (time.perf_counter() - t0) * 1000)
        return sbx

    async def resume(self, sandbox_id: str, state: RuntimeState) -> RuntimeState:
        async with self._lock(sandbox_id):
            self._cancel_release(sandbox_id)
            try:
                if sandbox_id in self._released:
                    sbx = await self._load_released(sandbox_id, run=True)
                else:
                    sbx = self._get(sandbox_id)
                    await sbx.machine.resume()
                # Clock and RNG: a HELLO on the kept session carries them (VmSandbox.refresh); a
                # VM loaded from disk has no session yet, and its first one's HELLO does.
                await sbx.refresh()
            except MachineError as exc:
                raise RuntimeFailure(
                    f"sandbox {sandbox_id}: resume failed: {exc}", sandbox_id=sandbox_id
                ) from exc
            except (MuxError, OSError) as exc:
                raise SandboxUnreachable(
                    f"sandbox {sandbox_id}: envd unreachable after resume: {exc}", sandbox_id=sandbox_id
                ) from exc
            return self._state(sbx, self._specs.get(sandbox_id))

    async def _loaded_locked(self, sandbox_id: str) -> VmSandbox:
        """The live VM of a sandbox, brought back (paused) from disk if it was released. The
        caller holds the sandbox's lock."""
        if sandbox_id not in self._released:
            return self._get(sandbox_id)
        try:
            sbx = await self._load_released(sandbox_id, run=False)
        except MachineError as exc:
            raise RuntimeFailure(
                f"sandbox {sandbox_id}: restore from disk failed: {exc}", sandbox_id=sandbox_id
            ) from exc
        if self.release_after > 0:
            self._schedule_release(sandbox_id)
        return sbx

    async def kill(self, sandbox_id: str, state: RuntimeState | None = None) -> None:
        self._cancel_release(sandbox_id)
        await self._snapshots_written(sandbox_id)
        self._locks.pop(sandbox_id, None)
        sbx = self._sandboxes.pop(sandbox_id, None)
        spec = self._specs.pop(sandbox_id, None)
        workdir = spec.workdir if spec else _path(state, "workdir")
        rel = self._released.pop(sandbox_id, None)
        if rel is not None:
            await asyncio.to_thread(_rm_dirs, rel.run_dir, workdir)
            return
        if sbx is not None:
            await sbx.aclose(extra_dir=workdir)
            return
        # Not ours in memory (server restarted): end the process recorded in the state, if it is
        # still the QEMU we started (its command line names our QMP socket).
        if state is not None:
            _kill_recorded(state)
            for key in ("run_dir", "workdir"):
                p = _path(state, key)
                if p is not None:
                    await asyncio.to_thread(shutil.rmtree, p, True)

    async def reconcile(self, known_ids: set[str] | list[str]) -> dict[str, list[str]]:
        """Kill QEMU processes and remove run dirs under our run root that no live sandbox, pool
        entry or template build owns (leftovers of a crash). Call after ``start`` and adopting."""
        await self.start()
        keep = {s.run_dir.name for s in self._sandboxes.values()} | self.pool.names() | self.blank_pool.names()
        keep |= self._building
        keep |= {r.run_dir.name for r in self._released.values()}
        keep |= {str(k) for k in known_ids if k in self._sandboxes}
        report: dict[str, list[str]] = {"killed": [], "removed": []}
        procs = await asyncio.to_thread(qemu_cmdlines)
        for entry in sorted(self.run_root.iterdir()) if self.run_root.is_dir() else []:
            if entry.name in keep:
                continue
            marker = f"{entry}/".encode()
            for pid, cmdline in procs.items():
                if marker in cmdline:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    report["killed"].append(f"{pid} ({entry.name})")
            await asyncio.to_thread(shutil.rmtree, entry, True)
            report["removed"].append(entry.name)
        for mem in self.shm_dir.glob("sbx-*.mem") if self.shm_dir.is_dir() else []:
            if mem.name[4:-4] not in self._sandboxes:
                mem.unlink(missing_ok=True)
                report["removed"].append(mem.name)
        if report["killed"] or report["removed"]:
            log.warning("vm reconcile: killed %s, removed %s", report["killed"], report["removed"])
        return report

    async def adopt(self, sandbox_id: str, spec: SandboxSpec, state: RuntimeState) -> bool:
        """Re-attach to a VM left running by a previous server: same pid (pidfd), QMP reconnected,
        channel reconnected on first use. False when it is gone (the caller then kills/cleans)."""
        await self.start()
        data = state.data
        try:
            cfg = config_from_json(data["config"])
            pid = int(data["pid"])
            run_dir = Path(data["run_dir"])
        except (KeyError, TypeError, ValueError, VmConfigError) as exc:
            if "released" not in data:
                log.warning("sandbox %s: cannot adopt, bad state: %s", sandbox_id, exc)
                return False
            cfg, pid, run_dir = None, -1, Path(str(data.get("run_dir", "")))
        if is_released(run_dir):
            # Released to disk (or killed after its state was complete): no process to attach.
            _kill_recorded(state)
            self._released[sandbox_id] = Released(
                str(data.get("name", sandbox_id)), run_dir, str(data.get("template_key", "")),
                _disk_generation(run_dir), spec.allow_internet,
            )  # fmt: skip
            self._specs[sandbox_id] = spec
            return True
        if cfg is None:
            return False
        try:
            machine = await Machine.attach(cfg, pid, stderr_path=run_paths(run_dir)["stderr"])
        except MachineError as exc:
            log.warning("sandbox %s: cannot adopt: %s", sandbox_id, exc)
            return False
        sbx = VmSandbox(
            str(data.get("name", sandbox_id)), machine, run_dir, str(data.get("template_key", ""))
        )
        sbx.restored = True
        if data.get("base_ram") and data.get("ram_image"):
            sbx.base_ram, sbx.ram_image = Path(data["base_ram"]), Path(data["ram_image"])
            sbx.mem_chain = [Path(p) for p in data.get("mem_chain") or []]
        # Disk checkpoints of earlier snapshots stacked root.N.qcow2 overlays; QEMU writes the top one.
        sbx.disk_generation = _disk_generation(run_dir)
        self._sandboxes[sandbox_id] = sbx
        self._specs[sandbox_id] = spec
        with contextlib.suppress(MachineError):
            if self.release_after > 0 and await machine.status() == "paused":
                self._schedule_release(sandbox_id)  # the idle clock restarts with the server
        return True

    async def metrics(self, sandbox_id: str) -> ResourceSample:
        spec = self._specs.get(sandbox_id)
        rel = self._released.get(sandbox_id)
        if rel is not None:  # no process: no CPU, no RAM; the disk is what remains
            used = sum(p.stat().st_blocks * 512 for p in rel.run_dir.glob("root*.qcow2"))
            return ResourceSample(
                timestamp=time.time(), cpu_count=spec.cpu_count if spec else 1, cpu_used_pct=0.0,
                mem_used=0, mem_total=(spec.memory_mb if spec else 0) * 2**20, mem_cache=0,
                disk_used=used, disk_total=(spec.disk_mb if spec else self.settings.default_disk_mb) * 2**20,
            )  # fmt: skip
        sbx = self._get(sandbox_id)
        pid = sbx.machine.pid
        cpu_count = spec.cpu_count if spec else sbx.machine.cfg.cpu_count
        cpu_s, rss = await asyncio.to_thread(_proc_usage, pid)
        now = time.monotonic()
        pct = 0.0
        if sbx.last_cpu is not None:
            t0, c0 = sbx.last_cpu
            if now > t0:
                pct = max(0.0, (cpu_s - c0) / ((now - t0) * cpu_count) * 100.0)
        sbx.last_cpu = (now, cpu_s)
        root = run_paths(sbx.run_dir)["root"]
        disk_used = root.stat().st_blocks * 512 if root.exists() else 0
        mem_total = sbx.machine.cfg.memory_mb * 2**20
        return ResourceSample(
            timestamp=time.time(), cpu_count=cpu_count, cpu_used_pct=round(min(pct, 100.0), 2),
            mem_used=min(rss, mem_total), mem_total=mem_total, mem_cache=0,
            disk_used=disk_used, disk_total=(spec.disk_mb if spec else self.settings.default_disk_mb) * 2**20,
        )  # fmt: skip

    def capabilities(self) -> dict[str, Any]:
        return {
            "runtime": "vm",
            "isolation": "QEMU microvm: own guest kernel",
            "accelerator": None
            if self.accel is None
            else {"name": self.accel.accel, "reason": self.accel.reason},
            "pause": "qmp stop; saved to disk and QEMU ended after "
            f"{self.release_after:g} s paused (vm_release_paused_after)",
            "network": {"offline": "user-mode netdev restrict=on", "internet": "QEMU user-mode (slirp) in its own netns: slirp4netns + in-netns filter"
                        if netjail.available() else None},
            "snapshot": "full (device state + RAM + disk)",
            "fork": "full snapshot + restore",
            "pool_size": self.pool_size,
        }

    # ---- helpers for tests and diagnostics ------------------------------------------------------
    def sandbox(self, sandbox_id: str) -> VmSandbox:
        return self._get(sandbox_id)


def sweep_orphan_ram(shm_root: Path) -> list[Path]:
    """Remove template RAM dirs (``aenv-*`` in ``shm_root``) whose state dir no longer exists,
    e.g. after a test server's temporary state was deleted. RAM in tmpfs is the costly leak."""
    removed: list[Path] = []
    for d in shm_root.glob("aenv-*"):
        try:
            owner = Path((d / OWNER_FILE).read_text().strip())
        except OSError:
            continue
        if not owner.exists():
            frozen.remove_tree(d)
            removed.append(d)
    if removed:
        log.info("vm: removed template RAM of deleted state dirs: %s", [str(p) for p in removed])
    return removed


def shm_dir_for(state_dir: Path) -> Path:
    """Where a server on ``state_dir`` keeps its template RAM in /dev/shm (``VmRuntime.shm_dir``)."""
    digest = hashlib.sha256(str(state_dir).encode()).hexdigest()[:10]
    return templates.SHM_DIR.with_name(f"aenv-{digest}")


def _short_run_root(preferred: Path) -> Path:
    """``preferred`` unless socket paths under it could exceed the AF_UNIX limit; then a short
    directory in the temp dir, named by a hash of ``preferred`` so it is stable across restarts."""
    if len(str(preferred)) <= 64:
        return preferred
    digest = hashlib.sha256(str(preferred).encode()).hexdigest()[:10]
    return Path(tempfile.gettempdir()) / f"aenv-vm-{digest}"


def _apply_layers(machine: Machine, snapshot: Path, names: list[str], run_dir: Path) -> list[Path]:
    """Write a snapshot's RAM layers, oldest first, into a waiting QEMU; link them into the run dir
    (the VM's parent chain for its own snapshots, kept even if the snapshot is deleted)."""
    memlayer.apply(machine.pid, machine.ram_mapping(), [snapshot / name for name in names])
    chain = [run_dir / f"mem.{i}.layer" for i in range(len(names))]
    for name, link in zip(names, chain, strict=True):
        _link_or_copy(snapshot / name, link)
    return chain


def _link_or_copy(src: Path, dst: Path) -> None:
    """A hard link (same filesystem: no copy, the repository stores it once anyway), else a sparse copy."""
    if dst.exists() and os.path.samefile(src, dst):
        return  # e.g. a resumed VM's base image, released again
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        frozen.copy_sparse(src, dst)


def _rm_dirs(*dirs: Path | None) -> None:
    for d in dirs:
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)


def _path(state: RuntimeState | None, key: str) -> Path | None:
    raw = state.data.get(key) if state else None
    return Path(raw) if raw else None


def _kill_recorded(state: RuntimeState) -> None:
    pid, qmp = state.data.get("pid"), state.data.get("qmp")
    if not isinstance(pid, int) or not qmp:
        return
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return
    if str(qmp).encode() in cmdline:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def qemu_cmdlines() -> dict[int, bytes]:
    """pid → raw command line of every QEMU process we can see (reconcile, bench and test cleanup)."""
    out: dict[int, bytes] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if b"qemu-system" in cmd.split(b"\0", 1)[0]:
            out[int(d.name)] = cmd
    return out


def _proc_usage(pid: int) -> tuple[float, int]:
    """(CPU seconds, RSS bytes) of a process from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        tick = os.sysconf("SC_CLK_TCK")
        cpu = (int(fields[11]) + int(fields[12])) / tick
        rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        return cpu, rss
    except (OSError, IndexError, ValueError):
        return 0.0, 0

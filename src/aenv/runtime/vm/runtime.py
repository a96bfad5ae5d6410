"""``VmRuntime``: the Runtime protocol on QEMU microVMs that start by snapshot restore.

Front door for the orchestrator. A sandbox here is a ``VmSandbox`` (``sandbox.py``: a QEMU, its run
dir and its mux session); this class holds the host-wide facts (accelerator, guest artifacts, the
run root and the template-RAM dir) and the parts, one job each: which sandboxes exist
(``table.py``), templates (``template.py``), the warm and blank pools (``pool.py``), pause and
resume (``pausing.py``), pause to disk (``release.py``), snapshots, fork and rollback
(``snapshot.py``), restart (``reconcile.py``); the QEMU, disk and layer errors become aenv's in one
place (``errors.py``).

Create path::

    template shape known?  no → boot the template once, wait for envd, snapshot (template.py)
    pool hit  → a VM already restored from the template, envd answering (warm TCG cache)
    pool miss → spawn QEMU -incoming defer, migrate-incoming + cont
    then      → POST /init to envd over the mux (env vars, token, identity, clock, seed, limits)

Why the pool holds restored VMs and not just waiting processes: under TCG the first requests
through the guest's Python agent and envd after a restore pay for code translation, far more than
QEMU start-up (scripts/vm/bench_restore.py measures it); a pre-restored VM has paid it. Every
hand-out, restore, fork and resume gives the guest the host's wall time and fresh random bytes, so
forks of one snapshot never share random state.

Pause is ``stop`` (vCPUs halt, memory kept), then release to disk after a while (``release.py``).
A files-only pause ends QEMU and keeps the disk; its resume boots on that disk (``coldboot.py``).
Kill ends QEMU and removes the run dir. QEMUs outlive the server on purpose: ``close`` ends only
what holds no user state (pool QEMUs; the template RAM once no sandbox is left), and after a
restart ``adopt`` re-attaches and ``reconcile`` removes whatever under the run root nobody owns.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from aenv.config import Settings
from aenv.errors import RuntimeFailure, StateError
from aenv.kinds import SnapshotMode
from aenv.machine_key import MachineKey
from aenv.mux import ByteStream
from aenv.runtime import ksm, shaping
from aenv.runtime.base import ResourceSample, RuntimeState, SandboxSpec, SnapshotResult
from aenv.runtime.egress import ENFORCER
from aenv.runtime.netpolicy import EgressPolicy
from aenv.runtime.ns.disk import DiskQuota, remove_tree
from aenv.runtime.shaping import SHAPER, Bandwidth
from aenv.runtime.streams import open_checked

from . import coldboot, compat, disk, frozen, netjail
from . import reconcile as reconciling
from . import template as templates
from .accel import AccelChoice, choose_accel, qemu_binary
from .artifacts import GuestArtifacts, ensure, flavour_of, with_flavour
from .config import Accel, accel_append
from .errors import translated
from .initramfs import BUSYBOX, NESTED_WORD
from .kernel import SOURCE_TARBALL, find_kernel
from .machine import Machine, MachineError
from .pausing import VmPausing
from .pool import RestorePool
from .release import Releaser
from .sandbox import VmSandbox, child_config, remove_dirs, run_paths
from .snapshot import VmSnapshots
from .table import VmTable
from .volumes import VolumeExports

log = logging.getLogger("aenv.runtime.vm")

POOL_NICE = 10  # CPU priority of pool entries until handed out
SPARE_STREAMS = 2  # envd streams a pool entry opens ahead: one for the create's /init, one for the client


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
        self.warm_timeout = warm_timeout
        self.boot_timeout = boot_timeout  # a template's first boot, and a stopped sandbox's cold boot
        self.vm_dir = settings.state_dir / "vm"
        self.templates_dir = self.vm_dir / "templates"
        self.run_root = run_root or run_root_for(settings.state_dir)
        self.accel: AccelChoice | None = None
        self.machine_key: MachineKey | None = None  # what saved state restores on (compat.py), set by start()
        self._template_ids: dict[str, str] = {}  # template key -> the template ID it was built from
        self.guest_append: tuple[str, ...] = ()  # accelerator-specific kernel words, set by start()
        self.table = VmTable()
        self.exports = VolumeExports(self.vm_dir / "exports")  # E2B volumes' 9p exports (volumes.py)
        # Where volumes count against a limit: the node's sandboxes volume, the btrfs quota volume ns
        # keeps its sandboxes on (ns/disk.py; ns_disk_quota, ns_volume_mb), a subvolume per volume.
        self.disk = DiskQuota(settings.state_dir, settings.sandboxes_dir, enabled=settings.ns_disk_quota,
                              size_mb=settings.ns_volume_mb)
        self.templates = templates.TemplateCache(self.templates_dir, self.frozen_dir, self.run_root, boot_timeout,
                                                 mem_merge=ksm.decide(settings).merge)
        self.pool = RestorePool(self.pool_size, self._spawn_warm)
        self.blank_pool = RestorePool(self.pool_size, self._spawn_blank)  # see VmSnapshots.blank_pool
        self.release = Releaser(self.table, self.templates, self.shm_dir, settings.vm_release_paused_after,
                                settings.vm_memory_low_mb, machine=self.machine, exports=self.exports)
        self.snapshots = VmSnapshots(self.table, self.templates, self.release, self.blank_pool,
                                     run_root=self.run_root, shm_dir=self.shm_dir,
                                     pids_limit=settings.pids_limit, start=self.start, machine=self.machine,
                                     exports=self.exports)
        self.pausing = VmPausing(self.table, self.templates, self.release, self.exports, shm_dir=self.shm_dir,
                                 pids_limit=settings.pids_limit, boot_timeout=boot_timeout)
        self._start_lock = asyncio.Lock()
        self._started = False
        self._flavours: dict[str, GuestArtifacts] = {}  # kernel flavour -> the artifacts it boots with
        self._flavour_lock = asyncio.Lock()  # one kernel build at a time

    # ---- host-wide lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        async with self._start_lock:
            if self._started:
                return
            self.accel = choose_accel(force=self.force_accel)
            self.guest_append = accel_append(self.accel.accel, self.settings.vm_guest_aslr)
            self.machine_key = await asyncio.to_thread(compat.host_key, self.accel.accel)
            log.info(
                "vm runtime: accelerator %s (%s); machine %s; guest kernel words %s", self.accel.accel,
                self.accel.reason, self.machine_key, " ".join(self.guest_append) or "(defaults)",
            )  # fmt: skip
            if self.artifacts is None:
                if self.tools_dir is None:
                    from aenv.runtime.tools import ensure_tools

                    self.tools_dir = await asyncio.to_thread(ensure_tools, self.settings)
                self.artifacts = await ensure(self.settings.cache_dir, self.tools_dir)
            for d in (self.templates_dir, self.run_root, self.shm_dir):
                d.mkdir(parents=True, exist_ok=True)
            (self.shm_dir / reconciling.OWNER_FILE).write_text(str(self.settings.state_dir))
            await asyncio.to_thread(reconciling.sweep_orphan_ram, self.shm_dir.parent)
            await asyncio.to_thread(frozen.ensure, self.frozen_dir)
            await asyncio.to_thread(self.disk.setup)  # before Volumes.start makes its directory there
            self.release.start()
            self._started = True

    async def close(self) -> None:
        """End what holds no user state: the pools' QEMUs (warm and blank, spawns in flight too),
        the release timers and the memory watch; and, when no sandbox of this state dir is left
        under the run root, the template RAM in /dev/shm (a restart copies it back from disk).
        Handed-out sandboxes keep running: a restart adopts them."""
        await self.release.aclose()
        await self.snapshots.drain()  # snapshot files still being written: let them land
        await self.pool.aclose()
        await self.blank_pool.aclose()
        for sbx in self.table.running.values():
            await sbx.drop_session()
        if self._started and not self.templates.building and not await asyncio.to_thread(self._sandboxes_left):
            await asyncio.to_thread(frozen.remove_tree, self.shm_dir)
            log.info("vm runtime: no sandbox left; template RAM %s removed", self.shm_dir)
        await asyncio.to_thread(self.disk.release)  # unmounted unless another runtime holds it

    def _sandboxes_left(self) -> bool:
        """Any sandbox of this state dir, running, paused or released (their run dirs; the pools'
        are gone by now)."""
        return bool(self.table.running or self.table.released) or (
            self.run_root.is_dir() and any(self.run_root.iterdir()))

    async def forget_template(self, template_id: str) -> None:
        """The template is deleted: end the pool entries (warm and blank) of every template built
        from it and drop those from the template cache. Sandboxes of it keep running; its files
        stay (snapshots layered on its RAM need them)."""
        for pool in (self.pool, self.blank_pool):
            for key in pool.template_keys():
                if templates.built_from(key, template_id):
                    await pool.drop_template(key)
        self.templates.forget(template_id)

    # ---- templates and pool entries -------------------------------------------------------------
    async def template_for(self, spec: SandboxSpec) -> templates.FrozenTemplate:
        """The snapshot for this template and shape, built on first use (one build per key)."""
        await self.start()
        assert self.accel is not None and self.artifacts is not None
        shape = templates.Shape(spec.cpu_count, spec.memory_mb, spec.disk_mb)
        art = await self._artifacts_for(flavour_of(spec.template))
        append = self.guest_append + ((NESTED_WORD,) if spec.template.nested_containers else ())
        tpl = await self.templates.for_image(spec.template, shape, self.accel, art, append)
        self._template_ids[tpl.key] = spec.template.template_id  # the key keeps only 24 characters of it
        return tpl

    async def _artifacts_for(self, flavour: str) -> GuestArtifacts:
        """The guest artifacts with the kernel of ``flavour`` (``artifacts.flavour_of``)."""
        assert self.artifacts is not None
        if (art := self._flavours.get(flavour)) is None:
            async with self._flavour_lock:
                if (art := self._flavours.get(flavour)) is None:
                    art = await with_flavour(self.artifacts, self.settings.cache_dir, flavour)
                    self._flavours[flavour] = art
        return art

    async def _spawn_blank(self, name: str, template_key: str, allow_internet: bool) -> VmSandbox:
        """A QEMU process waiting for the device state of a layered snapshot of this template
        (``xen-save-devices-state`` streams have no configuration section)."""
        sbx = await self._spawn_restore(name, template_key, allow_internet, send_configuration=False)
        sbx.machine.set_nice(POOL_NICE)
        return sbx

    async def _spawn_restore(
        self, name: str, template_key: str, allow_internet: bool, send_configuration: bool = True,
        share: Path | None = None,
    ) -> VmSandbox:
        """A QEMU process waiting for this template's device state (not yet restored)."""
        tpl = self.templates.get(template_key)
        run_dir = self.run_root / name
        run_dir.mkdir(parents=True)
        try:
            p = run_paths(run_dir)
            await asyncio.to_thread(disk.clone_overlay, tpl.empty_overlay, p["root"])
            cfg = replace(child_config(tpl.cfg, name, run_dir, allow_internet, share),
                          send_configuration=send_configuration)
            machine = await Machine.spawn(cfg, stderr_path=p["stderr"])
        except BaseException:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise
        sbx = VmSandbox(name, machine, run_dir, template_key)
        sbx.base_ram, sbx.ram_image = tpl.mem_path, tpl.ram_image
        return sbx

    async def _spawn_warm(self, name: str, template_key: str, allow_internet: bool) -> VmSandbox:
        """A pool entry: restored, resumed and with envd answering, so that a create only has to
        send ``/init``. Under TCG this matters most: a fresh QEMU has an empty translation cache,
        and the first requests through agent and envd (Python) are slow."""
        tpl = self.templates.get(template_key)
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
        if sid in self.table.running:
            raise StateError(f"sandbox {sid} already exists", sandbox_id=sid)
        try:
            tpl = await self.template_for(spec)
        except Exception as exc:
            raise RuntimeFailure(f"sandbox {sid}: template: {exc}", sandbox_id=sid) from exc
        # A pooled QEMU has run the template's start command under the base filter since it was
        # pooled: with a policy, a QEMU of its own, jailed with the policy before the guest runs.
        policy_first = bool(spec.template.start_cmd) and ENFORCER.has(sid)
        # A pooled QEMU serves the template's empty export: one with volumes starts after its binds.
        share = await asyncio.to_thread(self.exports.prepare, spec)
        sbx: VmSandbox | None = (None if policy_first or share or spec.in_burst
                                 else self.pool.take(tpl.key, spec.allow_internet))
        t0 = time.perf_counter()
        if sbx is not None:
            sbx.machine.set_nice(0)
        with translated(sid, "restore", after="restore"):
            try:
                if sbx is None:
                    sbx = await self._spawn_restore(sid, tpl.key, spec.allow_internet, share=share)
                    sbx.volumes = spec.volumes if share else ()
                elif sbx.machine.cfg.network == "user":  # jailed under its pool name, with the default limits
                    await netjail.reshape(sid, sbx.machine.proc.pid)
                if not sbx.restored:
                    await sbx.machine.restore(tpl.device_state)
                    sbx.restored = True
                t_restored = time.perf_counter()
                await sbx.init_envd(spec, self.settings.pids_limit)
                await sbx.check_volumes(spec.access_token)
            except BaseException:
                if sbx is not None:
                    await sbx.aclose(extra_dir=spec.workdir)
                await asyncio.to_thread(self.exports.release, sid)
                raise
        t_end = time.perf_counter()
        sbx.machine.timings.extra.update(
            create_ms=(t_end - t0) * 1000, restore_ms=(t_restored - t0) * 1000, init_ms=(t_end - t_restored) * 1000,
        )  # fmt: skip
        log.info(
            "sandbox %s: from %s in %.1f ms (restore %.1f, envd init %.1f)",
            sid, tpl.key, (t_end - t0) * 1000, (t_restored - t0) * 1000, (t_end - t_restored) * 1000,
        )  # fmt: skip
        self.table.add(sid, sbx, spec)
        await self._egress_ensure(sid)  # a pooled QEMU was filtered under its pool name
        return self.table.state(sbx, spec)

    async def open_stream(self, sandbox_id: str, port: int) -> ByteStream:
        sbx = self.table.get(sandbox_id)
        return await open_checked(
            sandbox_id, port, sbx.open_stream, lambda: sbx.machine.alive, channel_errors=(MachineError,)
        )

    async def pause(self, sandbox_id: str, keep_memory: bool = True) -> RuntimeState:
        """In RAM, then to disk after a while; files only: QEMU ends, the disk stays (``pausing.py``)."""
        return await self.pausing.pause(sandbox_id, keep_memory)

    async def resume(self, sandbox_id: str, state: RuntimeState, keep_memory: bool = True) -> RuntimeState:
        """From RAM or disk; without memory, a cold boot on its disk (``pausing.py``)."""
        return await self.pausing.resume(sandbox_id, keep_memory)

    async def kill(self, sandbox_id: str, state: RuntimeState | None = None) -> None:
        ENFORCER.forget(sandbox_id)
        SHAPER.forget(sandbox_id)
        self.release.cancel(sandbox_id)
        await self.snapshots.written(sandbox_id)
        sbx, rel, spec = self.table.remove(sandbox_id, drop_lock=True)
        workdir = spec.workdir if spec else _path(state, "workdir")
        if rel is not None:
            await asyncio.to_thread(remove_dirs, rel.run_dir, workdir)
        elif sbx is not None:
            await sbx.aclose(extra_dir=workdir)
        elif state is not None:
            # Not ours in memory (server restarted): end the process recorded in the state, if it is
            # still the QEMU we started (its command line names our QMP socket).
            reconciling.kill_recorded(state)
            await asyncio.to_thread(remove_dirs, _path(state, "run_dir"), _path(state, "workdir"))
        await asyncio.to_thread(self.exports.release, sandbox_id)  # after its QEMU ended

    async def reconcile(self, known_ids: set[str] | list[str]) -> dict[str, list[str]]:
        """Kill QEMU processes and remove run dirs under our run root that no live sandbox, pool
        entry or template build owns (leftovers of a crash). Call after ``start`` and adopting."""
        await self.start()
        keep = self.table.run_dir_names() | self.pool.names() | self.blank_pool.names() | self.templates.building
        keep |= {str(k) for k in known_ids if k in self.table.running}
        out = await reconciling.reconcile(self.run_root, self.shm_dir, keep, set(self.table.running))
        owners = {str(k) for k in known_ids} | set(self.table.running) | set(self.table.released)
        out["volume_exports"] = await asyncio.to_thread(self.exports.sweep, owners)
        return out

    async def adopt(self, sandbox_id: str, spec: SandboxSpec, state: RuntimeState, stopped: bool = False) -> bool:
        """Re-attach to a VM left running by a previous server (see ``reconcile.adopt``), or, with
        ``stopped``, take back a stopped one's disk (``coldboot.adopt_stopped``). False when it is
        gone (the caller then kills/cleans)."""
        await self.start()
        if stopped:
            return await asyncio.to_thread(coldboot.adopt_stopped, self.table, sandbox_id, spec, state) is not None
        found = await reconciling.adopt(self.table, sandbox_id, spec, state)
        if isinstance(found, VmSandbox):
            if found.machine.cfg.share_dir == self.exports.share_for(spec):
                found.volumes = spec.volumes  # the same QEMU: the guest keeps its mounts
            await self.release.adopted(sandbox_id, found)
        return found is not None

    async def metrics(self, sandbox_id: str) -> ResourceSample:
        spec = self.table.specs.get(sandbox_id)
        disk_total = (spec.disk_mb if spec else self.settings.default_disk_mb) * 2**20
        rel = self.table.released.get(sandbox_id)
        if rel is not None:  # no process: no CPU, no RAM; the disk is what remains
            used = sum(p.stat().st_blocks * 512 for p in rel.run_dir.glob("root*.qcow2"))
            return ResourceSample(
                timestamp=time.time(), cpu_count=spec.cpu_count if spec else 1, cpu_used_pct=0.0,
                mem_used=0, mem_total=(spec.memory_mb if spec else 0) * 2**20, mem_cache=0,
                disk_used=used, disk_total=disk_total,
            )  # fmt: skip
        sbx = self.table.get(sandbox_id)
        cpu_count = spec.cpu_count if spec else sbx.machine.cfg.cpu_count
        cpu_s, rss = await asyncio.to_thread(_proc_usage, sbx.machine.pid)
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
            mem_used=min(rss, mem_total), mem_total=mem_total, mem_cache=0, disk_used=disk_used,
            disk_total=disk_total,
        )  # fmt: skip

    # ---- MachineBound and WarmReporting (runtime/base.py) -----------------------------------------
    def machine(self) -> MachineKey | None:
        """The machine this host's saved state restores on (compat.py); None until started."""
        return self.machine_key

    def check_restore(self, what: str, result: SnapshotResult) -> None:
        compat.check(result.data, self.machine_key, what)

    def warm_counts(self) -> dict[str, int]:
        """Ready pool entries per template ID (every shape and network mode of it together)."""
        out: dict[str, int] = {}
        for key, n in self.pool.ready_counts().items():
            if n and (template_id := self._template_ids.get(key)) is not None:
                out[template_id] = out.get(template_id, 0) + n
        return out

    # ---- SnapshotCapable (see snapshot.py) -------------------------------------------------------
    def _refuse_stopped(self, sandbox_id: str, action: str) -> None:
        rel = self.table.released.get(sandbox_id)
        if rel is not None and not rel.memory:
            raise StateError(f"cannot {action} sandbox {sandbox_id}: it is paused without memory (no VM); "
                             "resume it first", sandbox_id=sandbox_id)

    async def snapshot(self, sandbox_id: str, into: Path, mode: SnapshotMode) -> SnapshotResult:
        self._refuse_stopped(sandbox_id, "snapshot")
        return await self.snapshots.snapshot(sandbox_id, into, mode)

    async def create_from_snapshot(self, spec: SandboxSpec, snapshot: Path, result: SnapshotResult) -> RuntimeState:
        state = await self.snapshots.create_from_snapshot(spec, snapshot, result)
        await self._egress_ensure(spec.sandbox_id)  # it may be a QEMU of the blank pool
        return state

    async def fork_mode(self, sandbox_id: str) -> SnapshotMode:
        return await self.snapshots.fork_mode(sandbox_id)

    async def rollback(self, sandbox_id: str, spec: SandboxSpec, snapshot: Path, result: SnapshotResult) -> RuntimeState:
        self._refuse_stopped(sandbox_id, "roll back")
        state = await self.snapshots.rollback(sandbox_id, spec, snapshot, result)
        await self._egress_ensure(sandbox_id)
        return state

    # ---- bandwidth limits (runtime/shaping.py) ----------------------------------------------------
    async def set_bandwidth(self, sandbox_id: str, bw: Bandwidth | None) -> None:
        await shaping.register(sandbox_id, bw)

    # ---- egress policy (runtime/egress.py) --------------------------------------------------------
    async def set_egress(self, sandbox_id: str, policy: EgressPolicy | None) -> None:
        """Register the sandbox's policy: every QEMU started for it from now on has it in its jail's
        filter from the start (netjail.connect); a running one gets it now."""
        ENFORCER.register(sandbox_id, policy)
        sbx = self.table.running.get(sandbox_id)
        if sbx is not None and sbx.machine.cfg.network == "user" and sbx.machine.alive:
            await ENFORCER.install(sandbox_id, sbx.machine.proc.pid, await asyncio.to_thread(netjail.host_addresses),
                                   jail=True)
            await sbx.update_relay(sandbox_id)

    async def _egress_ensure(self, sandbox_id: str) -> None:
        sbx = self.table.running.get(sandbox_id)
        if sbx is not None and sbx.machine.cfg.network == "user" and ENFORCER.has(sandbox_id):
            await ENFORCER.ensure(sandbox_id, sbx.machine.proc.pid, await asyncio.to_thread(netjail.host_addresses),
                                  jail=True)

    def capabilities(self) -> dict[str, Any]:
        return {
            "runtime": "vm",
            "isolation": "QEMU microvm: own guest kernel",
            "accelerator": None
            if self.accel is None
            else {"name": self.accel.accel, "reason": self.accel.reason},
            "pause": "qmp stop; saved to disk and QEMU ended after "
            f"{self.release.release_after:g} s paused (vm_release_paused_after); "
            "files only: guest sync, QEMU ended, cold boot on its disk at resume",
            "network": {"offline": "user-mode netdev restrict=on", "internet": "QEMU user-mode (slirp) in its own netns: slirp4netns + in-netns filter"
                        if netjail.available() else None},
            "snapshot": "full (device state + RAM + disk)",
            "fork": "full snapshot + restore",
            "disk quota (volumes)": self.disk.describe(),
            "volumes": "9p export per sandbox (virtio-9p): its volumes bound nodev,nosuid, read-only ones ro on the host",
            "pool_size": self.pool_size,
            "machine": self.machine_key,
        }

    # ---- VolumeCapable (runtime/base.py) ----------------------------------------------------------
    def make_volume_dir(self, path: Path, limit_mb: int) -> None:
        self.disk.make_volume_dir(path, limit_mb)  # the guest's writes through QEMU stop at the limit too

    def remove_volume_dir(self, path: Path) -> None:
        remove_tree(path)

    # ---- helpers for tests and diagnostics ------------------------------------------------------
    def sandbox(self, sandbox_id: str) -> VmSandbox:
        return self.table.get(sandbox_id)

    async def relieve_pressure(self) -> list[str]:
        """One memory-pressure round now (see ``Releaser.relieve_pressure``)."""
        return await self.release.relieve_pressure()


def shm_dir_for(state_dir: Path) -> Path:
    """Where a server on ``state_dir`` keeps its template RAM in /dev/shm (``VmRuntime.shm_dir``)."""
    digest = hashlib.sha256(str(state_dir).encode()).hexdigest()[:10]
    return templates.SHM_DIR.with_name(f"aenv-{digest}")


def run_root_for(state_dir: Path) -> Path:
    """Where a server on ``state_dir`` keeps its VMs' run dirs (one per sandbox, named by its ID)."""
    return _short_run_root(state_dir / "vm" / "run")


def _short_run_root(preferred: Path) -> Path:
    """``preferred`` unless socket paths under it could exceed the AF_UNIX limit; then a short
    directory in the temp dir, named by a hash of ``preferred`` so it is stable across restarts."""
    if len(str(preferred)) <= 64:
        return preferred
    digest = hashlib.sha256(str(preferred).encode()).hexdigest()[:10]
    return Path(tempfile.gettempdir()) / f"aenv-vm-{digest}"


def _path(state: RuntimeState | None, key: str) -> Path | None:
    raw = state.data.get(key) if state else None
    return Path(raw) if raw else None


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

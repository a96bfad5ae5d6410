"""``NsRuntime``: the Runtime protocol on namespaces + overlayfs + cgroups (no VM).

Front door for the orchestrator. A sandbox here is an ``NsSandbox`` (see ``sandbox.py`` for what it
owns); this class composes the parts and does the create path itself. It makes the host-wide facts
(``host.py``: cgroup layout, tools bundle, host addresses, filled in by ``start``) and the table of
live sandboxes (``table.py``) and passes both to every part's constructor, with the runtime's own
broad operations (``start``, ``_launch_ready``, ``_prelaunch``) as callables where a part needs one:
no part imports this module (an ``acyclic_siblings`` contract in ``pyproject.toml`` keeps it so).

Create path:
    pool hit  -> rename cgroup + dir to the real ID, apply limits, ``POST /init``     (~ms)
    pool miss -> launch under the real ID (unshare, overlay, agent, envd), ``GET /health``,
                 ``POST /init``                                                        (~0.3 s)
Either way the key becomes hot and the pool refills in the background.

Pause, resume, kill and adoption after a restart: ``lifecycle.py``. Snapshots, fork, rollback:
``snapshot.py``; release of paused sandboxes to disk: ``release.py``; process images for starts the
pool cannot serve: ``procimage.py``; a restored process tree made a live sandbox: ``restored.py``.

Disk: every sandbox directory (pool and handed-out) lives on the sandboxes dir, which is a btrfs
volume with one quota-limited subvolume per sandbox when the host allows it (``disk.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from aenv.config import Settings
from aenv.errors import InvalidRequest, RuntimeFailure, SandboxUnreachable, StateError
from aenv.kinds import SnapshotMode
from aenv.mux import ByteStream, MuxError
from aenv.runtime import shaping
from aenv.runtime.base import ResourceSample, RuntimeState, SandboxImage, SandboxSpec, SnapshotResult
from aenv.runtime.egress import ENFORCER
from aenv.runtime.envd_client import ENVD_PORT, EnvdError, init_payload, until_ready
from aenv.runtime.netpolicy import EgressPolicy
from aenv.runtime.network import (
    close_orphaned_slirps,
    drop_foreign_rules,
    host_ipv4_addresses,
    slirp_available,
)
from aenv.runtime.ns import cgroups, identity
from aenv.runtime.ns.checkpoint import sweep_stages
from aenv.runtime.ns.disk import remove_tree
from aenv.runtime.ns.host import NsHost
from aenv.runtime.ns.lifecycle import NsLifecycle
from aenv.runtime.ns.pool import WarmPool
from aenv.runtime.ns.procimage import ProcImages
from aenv.runtime.ns.reconcile import ReconcileReport, reconcile
from aenv.runtime.ns.release import NsReleaser
from aenv.runtime.ns.restored import Restorer
from aenv.runtime.ns.sandbox import NsSandbox
from aenv.runtime.ns.snapshot import NsSnapshots
from aenv.runtime.ns.table import NsTable
from aenv.runtime.ns.zygote import Zygote, socket_path_for, sweep_stale_sockets
from aenv.runtime.shaping import SHAPER, Bandwidth
from aenv.runtime.streams import open_checked
from aenv.runtime.tools import ensure_tools

log = logging.getLogger("aenv.runtime.ns")

LEGACY_POOL_DIR = "ns-pool"  # <state>/ns-pool before the pool moved onto the sandboxes volume
READY_TIMEOUT_S = 120.0  # a template's ready command, from the launch (vm: from the template boot)
READY_INTERVAL_S = 0.05  # between its runs: a start command on ns is up in a second or two


def _disk_usage(path: Path) -> int:
    """Bytes allocated under ``path`` (like ``du``), not following symlinks."""
    total = 0
    stack = [str(path)]
    while stack:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    total += st.st_blocks * 512
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
        except OSError:
            continue
    return total


class NsRuntime:
    name = "ns"

    def __init__(self, settings: Settings, pool_size: int | None = None, *, tools_dir: Path | None = None,
                 debug_log: bool | None = None, launch_timeout: float = 30.0) -> None:
        self.settings = settings
        self.pool_size = settings.pool_size if pool_size is None else pool_size
        debug = (settings.log_level.lower() == "debug" or os.environ.get("AENV_NS_DEBUG") == "1") \
            if debug_log is None else debug_log
        # Who gets what (no part imports this module): the host's facts and the sandbox table are
        # shared by all; the runtime's own broad operations go to a part as callables.
        self.host = NsHost(settings, tools_dir=tools_dir, debug_log=debug, launch_timeout=launch_timeout)
        self.table = NsTable()
        self.pool = WarmPool(self.pool_size, self._launch_pooled)
        self.restorer = Restorer(self.host, self.table)
        self.snapshots = NsSnapshots(self.table, self.host, self.restorer, start=self.start,
                                     launch_ready=self._launch_ready, prelaunch=self._prelaunch)
        self.releaser = NsReleaser(self.table, self.host, self.restorer, settings.ns_release_paused_after)
        self.procimages = ProcImages(self.host, self.snapshots)
        self.lifecycle = NsLifecycle(self.table, self.host, self.releaser, start=self.start,
                                     launch_ready=self._launch_ready)
        self._started = False
        self._slirp_sweeper: asyncio.Task[None] | None = None

    # ---- host-wide lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        if self._started:
            return
        host, s = self.host, self.settings
        host.layout = layout = await asyncio.to_thread(cgroups.detect, None, cgroups.scope_for(s.state_dir))
        await asyncio.to_thread(cgroups.ensure_parents, layout)
        if host.tools is None:
            host.tools = await asyncio.to_thread(ensure_tools, s)
        host.host_addrs = await asyncio.to_thread(host_ipv4_addresses)
        await asyncio.to_thread(host.disk.setup)  # mounts the sandboxes volume (before any launch)
        s.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        host.pool_dir.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(host.check_userns)
        if swept := await asyncio.to_thread(sweep_stages):
            log.info("ns: removed %d restore stage dirs a killed server left: %s", len(swept), ", ".join(swept))
        if host.zygote is None and await asyncio.to_thread(host.want_zygote):
            tmp = Path(tempfile.gettempdir())
            await asyncio.to_thread(sweep_stale_sockets, tmp)
            host.zygote = Zygote(host.tools, socket_path_for(tmp, os.getpid(), id(self)))
            await host.zygote.ensure()
        self._slirp_sweeper = asyncio.create_task(self._sweep_slirps(), name="aenv-ns-slirp-sweep")
        self._started = True

    async def _sweep_slirps(self, every: float = 5.0) -> None:
        """Now and then, the slirp4netns processes whose sandbox is gone are closed (``network.py``)."""
        while True:
            await asyncio.sleep(every)
            try:
                await close_orphaned_slirps()
            except Exception:  # noqa: BLE001 - the sweep must outlive one bad round
                log.exception("ns: slirp sweep failed")

    async def close(self) -> None:
        """Kill pooled sandboxes and drop channels; handed-out sandboxes keep running."""
        host = self.host
        if self._slirp_sweeper is not None:
            self._slirp_sweeper.cancel()
            self._slirp_sweeper = None
        await self.pool.aclose()
        await self.releaser.aclose()
        await self.procimages.aclose()
        if host.zygote is not None:
            await host.zygote.aclose()
            host.zygote = None
        for sbx in list(self.table.running.values()):
            await sbx.drop_connections()
        self.table.running.clear()
        await self.snapshots.drain()
        await close_orphaned_slirps()  # what the pool's and the killed sandboxes' ends left
        await asyncio.to_thread(host.disk.release)  # unmounts the volume unless another runtime uses it
        host.close_ranges()  # running sandboxes keep their namespaces alive themselves
        if host.layout is not None:
            await asyncio.to_thread(cgroups.remove_scope_if_empty, host.layout)

    async def reconcile(self, known_ids: set[str] | list[str]) -> ReconcileReport:
        """Kill and remove every ns sandbox, cgroup and directory not in ``known_ids`` (plus our own
        live pool). Call after ``start`` and before adopting."""
        await self.start()
        assert self.host.layout is not None
        keep = self.pool.names() | set(self.table.running)
        return await reconcile(self.host.layout, self.settings.sandboxes_dir,
                               [self.host.pool_dir, self.settings.state_dir / LEGACY_POOL_DIR], set(known_ids), keep)

    async def forget_template(self, template_id: str | None = None) -> None:
        """Drop pooled sandboxes of a template (call after rebuilding or deleting it)."""
        await self.pool.forget(template_id)

    def warm_counts(self) -> dict[str, int]:
        """Ready pooled sandboxes per template ID (WarmReporting)."""
        return self.pool.ready_counts()

    async def wait_warm(self, template: SandboxImage, allow_internet: bool = True, n: int | None = None,
                        uid_slot: int = 0) -> None:
        self.pool.want(template, allow_internet, uid_slot)
        await self.pool.wait_ready(template, allow_internet, n, uid_slot)

    # ---- launching ------------------------------------------------------------------------------
    async def _launch_pooled(self, template: SandboxImage, allow_internet: bool, uid_slot: int = 0) -> NsSandbox:
        host = self.host
        assert host.layout is not None
        await host.ensure_tools()
        name = f"pool-{secrets.token_hex(6)}"
        opts = host.pool_opts(template, allow_internet, uid_slot)
        sbx = await self.procimages.pooled(name, host.pool_dir / name, template, allow_internet, uid_slot)
        if sbx is None:  # no process image (yet): launched by exec
            sbx = await host.launch(name, host.pool_dir / name, opts)
        try:
            await sbx.warm_up()
            await self._until_ready(sbx, template)
            if sbx.allow_internet and sbx.init is not None:
                await sbx.egress.prepare(sbx.net_pid)
        except BaseException:  # cancelled (the pool closes): nobody would own it, so it ends here
            await sbx.aclose()
            raise
        return sbx

    async def _until_ready(self, sbx: NsSandbox, template: SandboxImage, token: str | None = None) -> None:
        """The template's ready command passes before the sandbox is handed out or returned: a create
        that found the pool empty used to answer while its start command (the code interpreter's
        service: ~1.5 s) was still coming up."""
        if template.ready_cmd:
            try:
                await until_ready(lambda: sbx.open_stream(ENVD_PORT), template.ready_cmd, READY_TIMEOUT_S,
                                  interval=READY_INTERVAL_S, token=token)
            except TimeoutError:
                raise RuntimeFailure(f"sandbox {sbx.name}: the template's ready command did not pass in "
                                     f"{READY_TIMEOUT_S:g} s: {template.ready_cmd}") from None

    # ---- VolumeCapable ----------------------------------------------------------------------------
    def make_volume_dir(self, path: Path, limit_mb: int) -> None:
        self.host.disk.make_volume_dir(path, limit_mb)

    def remove_volume_dir(self, path: Path) -> None:
        remove_tree(path)

    # ---- Runtime protocol -----------------------------------------------------------------------
    async def create(self, spec: SandboxSpec) -> RuntimeState:
        # A pooled sandbox has run its template's start command under the base filter since it was
        # pooled: with a policy, that command starts in a namespace that has the policy from the start.
        # Volumes are bound while the root is built: a sandbox with them is always launched for itself.
        use_pool = not (spec.template.start_cmd and ENFORCER.has(spec.sandbox_id)) and not spec.volumes
        return await self._egress_ensured(spec.sandbox_id, self._launch_ready(spec, spec.template, (), use_pool=use_pool))

    async def _prelaunch(self, name: str, root: Path, spec: SandboxSpec, template: SandboxImage,
                         snapshot_layers: tuple[str, ...]) -> NsSandbox:
        """Launch a sandbox for ``spec`` under a temporary name and directory (the rollback path
        starts the new one while the old one is still being stopped); ``_launch_ready(prelaunched=…)``
        then renames it into place, as the pool's hand-out does."""
        await self.start()
        host = self.host
        assert host.layout is not None
        await host.ensure_tools()
        opts = replace(host.opts(template, spec.allow_internet, (spec.cpu_count, spec.memory_mb, spec.pids_limit),
                                 disk_mb=spec.disk_mb, uid_slot=spec.uid_slot),
                       snapshot_layers=snapshot_layers, volumes=spec.volumes)
        return await host.launch(name, root, opts)

    async def _launch_ready(self, spec: SandboxSpec, template: SandboxImage, snapshot_layers: tuple[str, ...],
                            *, root: Path | None = None, use_pool: bool = False,
                            prelaunched: NsSandbox | None = None) -> RuntimeState:
        """Start ``spec`` on ``template``'s lowers with ``snapshot_layers`` stacked on top (a snapshot
        restore) and initialise envd. ``root`` defaults to ``<workdir>/ns``; rollback passes the
        existing one (and possibly a ``prelaunched`` sandbox to rename into it). Cleans up after
        itself on any failure."""
        await self.start()
        host = self.host
        assert host.layout is not None
        sid = spec.sandbox_id
        if sid in self.table.running:
            raise StateError(f"sandbox {sid} already exists", sandbox_id=sid)
        limits = (spec.cpu_count, spec.memory_mb, spec.pids_limit)
        in_place = root is not None  # rollback: on failure remove only the ns dir, not the whole workdir
        root = root or spec.workdir / "ns"
        sbx = prelaunched or (
            self.pool.take(spec.template, spec.allow_internet, spec.uid_slot)
            if use_pool and not spec.in_burst and not snapshot_layers else None)
        if sbx is None and not in_place and not spec.volumes:  # not pooled: the template's process image, if any
            restored = await self.procimages.start(spec, template, snapshot_layers)
            if restored is not None:
                return restored
        hand_out: Callable[[], None] | None = None
        boosted = False
        try:
            if sbx is not None and sbx is prelaunched:
                await asyncio.to_thread(sbx.rename, sid, root)
                assert sbx.init is not None
                await asyncio.to_thread(identity.set_hostname, sbx.init.pid, sid)
            elif sbx is not None:
                # Inline, not in a thread: a handful of small writes and one rename (~1 ms), cheaper
                # than the thread hop, and it is the create's hot path. It runs while envd handles
                # /init (see init_envd's ``meanwhile``).
                hand_out = functools.partial(self._hand_out, sbx, sid, root, limits, spec.disk_mb)
                # its CPU weight first, not meanwhile: at the pool's, its envd would answer /init behind
                # every other cgroup (a burst's restores: bursts.py)
                boosted = self._contended()
                sbx.cgroup.set_weight(low=False, high=boosted)
                # pooled under the base filter: a policy is written while /init and the answer go
                policy = sbx.allow_internet and sbx.init is not None and ENFORCER.has(sid)
                sbx.egress.hand_out(sid, functools.partial(ENFORCER.start_install, sid, sbx.net_pid, host.host_addrs)
                                    if policy and sbx.init is not None else None, sbx.cut_network)
            else:
                await host.ensure_tools()
                opts = replace(host.opts(template, spec.allow_internet, limits, disk_mb=spec.disk_mb,
                                         uid_slot=spec.uid_slot),
                               snapshot_layers=snapshot_layers, hostname=sid, volumes=spec.volumes)
                sbx = await host.launch(sid, root, opts, keep_root=in_place)
            if (hand_out is not None or sbx is prelaunched) and sbx.allow_internet and sbx.init and SHAPER.custom(sid):
                # made under another name, with the default limits: this sandbox's before it is used
                await asyncio.to_thread(SHAPER.apply, sid, sbx.net_pid)
            try:
                await sbx.init_envd(init_payload(spec), meanwhile=hand_out)
            finally:
                if boosted:  # the ordinary weight from its answer on, a live sandbox's
                    with contextlib.suppress(OSError):
                        sbx.cgroup.set_weight(low=False)
            if hand_out is None:  # launched for this create (a pooled one was ready before it was pooled)
                await self._until_ready(sbx, template, spec.access_token)
        except BaseException as exc:
            if sbx is not None:
                sbx.keep_root = sbx.keep_root or in_place  # its upper holds the sandbox's files
                await sbx.aclose(remove_dir=None if in_place else spec.workdir)
            if isinstance(exc, (EnvdError, MuxError)):
                raise SandboxUnreachable(f"sandbox {sid}: envd did not come up: {exc}", sandbox_id=sid) from exc
            if isinstance(exc, Exception) and not isinstance(exc, RuntimeFailure | StateError | InvalidRequest):
                raise RuntimeFailure(f"sandbox {sid}: start failed: {exc}", sandbox_id=sid) from exc
            raise
        sbx.last_cpu = None
        sbx.keep_root = False  # from now on a teardown removes what it started on, as any sandbox's
        self.table.add(sid, sbx, spec)
        return self.table.state(sbx, spec.workdir)

    def _contended(self) -> bool:
        """Whether another team's burst is starting (bursts.py): a hand-out then answers ``/init`` at a
        high CPU weight. Why: during the burst a hand-out's envd took 1-34 ms (median 4.0) to answer
        /init, against ~1 ms alone, beside the burst's sandboxes restored meanwhile (ordinary weight
        once restored) and the pool's refills (ordinary weight during a burst)."""
        return self.snapshots.bursts.busy and self.settings.team_burst_yield

    def _hand_out(self, sbx: NsSandbox, sid: str, root: Path, limits: tuple[int, int, int], disk_mb: int) -> None:
        if sbx.opts is not None and sbx.opts.disk is not None and sbx.opts.disk_mb != disk_mb:
            sbx.opts.disk.limit(sbx.paths.root, disk_mb)  # pooled at the default size
        if sbx.opts is None or sbx.opts.default_limits != limits:  # pooled at the default limits
            sbx.cgroup.set_limits(*limits)
        sbx.rename(sid, root)
        assert sbx.init is not None
        identity.set_hostname(sbx.init.pid, sid)  # pooled under the placeholder name (identity.py)

    async def open_stream(self, sandbox_id: str, port: int) -> ByteStream:
        sbx = self.table.get(sandbox_id)
        return await open_checked(sandbox_id, port, sbx.open_stream, sbx.alive)

    # ---- pause / resume / kill / adopt (see lifecycle.py) ---------------------------------------
    async def pause(self, sandbox_id: str, keep_memory: bool = True) -> RuntimeState:
        return await self.lifecycle.pause(sandbox_id, keep_memory)

    async def resume(self, sandbox_id: str, state: RuntimeState, keep_memory: bool = True) -> RuntimeState:
        return await self._egress_ensured(sandbox_id, self.lifecycle.resume(sandbox_id, state, keep_memory))

    async def kill(self, sandbox_id: str, state: RuntimeState | None = None) -> None:
        await self.lifecycle.kill(sandbox_id, state)

    async def adopt(self, sandbox_id: str, spec: SandboxSpec, state: RuntimeState, stopped: bool = False) -> bool:
        return await self.lifecycle.adopt(sandbox_id, spec, state, stopped)

    async def metrics(self, sandbox_id: str) -> ResourceSample:
        return await asyncio.to_thread(self._sample, sandbox_id)

    async def metrics_many(self, sandbox_ids: Sequence[str]) -> dict[str, ResourceSample]:
        """BatchSampling: the sampler's cycle in one thread hop."""
        return await asyncio.to_thread(self._sample_many, list(sandbox_ids))

    def _sample_many(self, sandbox_ids: list[str]) -> dict[str, ResourceSample]:
        out: dict[str, ResourceSample] = {}
        for sandbox_id in sandbox_ids:
            with contextlib.suppress(Exception):  # gone or between states since the list was made
                out[sandbox_id] = self._sample(sandbox_id)
        return out

    def _sample(self, sandbox_id: str) -> ResourceSample:
        """One sample (blocking: cgroup and quota files); off the event loop."""
        sbx = self.table.get(sandbox_id)
        spec = self.table.specs.get(sandbox_id)
        usage = sbx.cgroup.usage()
        disk = self._disk_used(sbx)
        now = time.monotonic()
        cpu_count = spec.cpu_count if spec else self.settings.default_cpu_count
        pct = 0.0
        if sbx.last_cpu is not None:
            t0, c0 = sbx.last_cpu
            if now > t0:
                pct = max(0.0, (usage.cpu_ns - c0) / ((now - t0) * 1e9 * cpu_count) * 100.0)
        sbx.last_cpu = (now, usage.cpu_ns)
        mem_total = usage.mem_limit or (spec.memory_mb * 1024 * 1024 if spec else 0)
        return ResourceSample(
            timestamp=time.time(), cpu_count=cpu_count, cpu_used_pct=round(min(pct, 100.0), 2),
            mem_used=max(0, usage.mem_used - usage.mem_cache), mem_total=mem_total, mem_cache=usage.mem_cache,
            disk_used=disk, disk_total=(spec.disk_mb if spec else self.settings.default_disk_mb) * 1024 * 1024,
        )

    def _disk_used(self, sbx: NsSandbox) -> int:
        used = self.host.disk.usage(sbx.paths.root)  # the quota's own count (upper + work + run)
        return used if used is not None else _disk_usage(sbx.paths.upper)

    # ---- SnapshotCapable (see snapshot.py) -------------------------------------------------------
    def _refuse_stopped(self, sandbox_id: str, action: str) -> None:
        if sandbox_id in self.releaser.released:
            raise StateError(f"cannot {action} sandbox {sandbox_id}: it is paused and released to disk; "
                             "resume it first", sandbox_id=sandbox_id)
        if sandbox_id in self.table.stopped:
            raise StateError(f"cannot {action} sandbox {sandbox_id}: it is paused without memory (no processes); "
                             "resume it first", sandbox_id=sandbox_id)

    async def snapshot(self, sandbox_id: str, into: Path, mode: SnapshotMode) -> SnapshotResult:
        self._refuse_stopped(sandbox_id, "snapshot")
        return await self.snapshots.snapshot(sandbox_id, into, mode)

    async def create_from_snapshot(self, spec: SandboxSpec, snapshot: Path, result: SnapshotResult) -> RuntimeState:
        return await self._egress_ensured(spec.sandbox_id, self.snapshots.create_from_snapshot(spec, snapshot, result))

    async def fork_mode(self, sandbox_id: str) -> SnapshotMode:
        return await self.snapshots.fork_mode(sandbox_id)

    async def rollback(self, sandbox_id: str, spec: SandboxSpec, snapshot: Path, result: SnapshotResult) -> RuntimeState:
        self._refuse_stopped(sandbox_id, "roll back")
        return await self._egress_ensured(sandbox_id, self.snapshots.rollback(sandbox_id, spec, snapshot, result))

    # ---- bandwidth limits (runtime/shaping.py) ----------------------------------------------------
    async def set_bandwidth(self, sandbox_id: str, bw: Bandwidth | None) -> None:
        await shaping.register(sandbox_id, bw)

    # ---- egress policy (runtime/egress.py) --------------------------------------------------------
    async def set_egress(self, sandbox_id: str, policy: EgressPolicy | None) -> None:
        """Register the sandbox's policy; a running one gets it in its filter now."""
        ENFORCER.register(sandbox_id, policy)
        sbx = self.table.running.get(sandbox_id)
        if sbx is not None:
            await sbx.egress.settled()  # after the hand-out's filter, never beside it
        if sbx is not None and sbx.allow_internet and sbx.init is not None and sbx.alive():
            await ENFORCER.install(sandbox_id, sbx.net_pid, self.host.host_addrs)
            if sbx.egress.foreign:  # ours is in force: an older server's rules go
                await drop_foreign_rules(sbx.net_pid)
                sbx.egress.foreign = False

    async def _egress_ensured(self, sandbox_id: str, started: Awaitable[RuntimeState]) -> RuntimeState:
        """``started``, then the sandbox's policy in its namespace if that is a new one (a pooled
        sandbox was filtered under its pool name, unless its hand-out is filtering it; a process restore
        made a fresh namespace)."""
        state = await started
        sbx = self.table.running.get(sandbox_id)
        if sbx is None or sbx.egress.pending:
            return state
        if sbx.allow_internet and sbx.init is not None and ENFORCER.has(sandbox_id):
            await ENFORCER.ensure(sandbox_id, sbx.net_pid, self.host.host_addrs)
        return state

    def yield_bursts(self, on: bool) -> None:
        """BurstYielding: a team's burst restores give way to another team's creates (``bursts.py``)."""
        self.snapshots.bursts.set(on)

    def capabilities(self) -> dict[str, Any]:
        host = self.host
        status = host.criu_status()
        process = "filesystem+processes (criu)" if status.usable and host.zygote is None else "filesystem"
        ranges = host.ranges_in_use()
        user = (f"user namespace (uids 0-65535 are host {host.userns.host_uid}.., or a range of the team's own "
                f"where the server has several teams; ranges in use: {len(ranges)})"
                if host.userns is not None else f"no user namespace ({host.userns_off_reason})")
        return {
            "runtime": "ns",
            "isolation": "namespaces (pid, mount, uts, ipc, net) + cgroups + capability bounding set; "
                         f"seccomp (Docker's default profile); {user}: weaker than vm",
            "cgroups": f"v{host.layout.version}" if host.layout else "unknown",
            "pause": "freezer, released to disk with CRIU after ns_release_paused_after s; "
                     "files only: processes end, cold start on resume",
            "network": {"offline": "loopback-only netns",
                        "internet": "slirp4netns + in-netns filter" if slirp_available() else None},
            "snapshot": process,
            "fork": process,
            "rollback": process,
            "criu": status.describe(),
            "disk quota": host.disk.describe(),
            "pool_size": self.pool_size,
            "docker inside": (("yes: rootless dockerd in a user namespace of its own, behind a router holding "
                               "its egress filter; no fork or snapshot") if host.userns is not None
                              else "no: it needs the user namespace") if host.settings.ns_nested_containers
                             else "refused (ns_nested_containers = false)",
        }

    # ---- helpers for tests and diagnostics ------------------------------------------------------
    def sandbox(self, sandbox_id: str) -> NsSandbox:
        return self.table.get(sandbox_id)

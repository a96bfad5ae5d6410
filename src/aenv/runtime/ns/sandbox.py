"""One namespace sandbox and everything it owns.

Ownership (released in reverse order by ``aclose``, which is idempotent and finishes under
cancellation):

    directory  <dir>/ (upper, work, run, ns.json, boot_id) removed last; with disk quotas a btrfs
                                                           subvolume limited to the disk size (disk.py)
    cgroup     <hierarchy>/aenv/<name>                     rmdir after every member died
    process    unshare (stage 1, our child) -> init (PID 1 of the sandbox: the agent)
    process    slirp4netns (internet mode only)
    socket     the mux session to <dir>/run/mux.sock

Mounts are all inside the sandbox's private mount namespace, so none exists on the host: they vanish
with the init process.

``ns.json`` in the directory repeats what ``RuntimeState.data`` holds (pid + start time, cgroup name,
slirp pid), so reconciliation after a crash can find and clean up a sandbox the store never heard of.

``boot_id`` is the sandbox's own ``/proc/sys/kernel/random/boot_id`` (bind-mounted read-only over the
host's): the kernel is shared, but each start of a sandbox is a boot of its own, so every launch
writes a new one and a freeze/thaw keeps it. The file sits outside upper and run, out of the
sandbox's reach.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import shutil
import stat
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aenv.agent import launch as launcher_mod
from aenv.agent.channel import ENVD_SOCKET
from aenv.faults import fault_point
from aenv.mux import ByteStream, MuxSession, StreamClosed
from aenv.mux.direct import DirectStream, open_direct
from aenv.mux.session import open_unix_session
from aenv.runtime.base import SandboxImage, VolumeBind
from aenv.runtime.egress import ENFORCER
from aenv.runtime.envd_client import (
    ENVD_PORT,
    EnvdError,
    read_response,
    request,
    send_request,
    warm_up_request,
)
from aenv.runtime.network import RESOLV_CONF, Slirp, kill_slirps_serving
from aenv.runtime.ns.cgroups import Cgroup, Layout
from aenv.runtime.ns.checkpoint import DEBUG_LOG
from aenv.runtime.ns.disk import DiskQuota, remove_tree
from aenv.runtime.ns.handout import HandOutFilter
from aenv.runtime.ns.paths import SOCKET_NAME, Paths
from aenv.runtime.ns.userns import SharedUserns
from aenv.runtime.ns.zygote import Zygote
from aenv.runtime.process import ProcRef, Reaped, proc_start_time
from aenv.runtime.tools import launch_argv

log = logging.getLogger(__name__)

RUN_MOUNT = "/.aenv-run"


class LaunchError(RuntimeError):
    pass


@dataclass(frozen=True)
class LaunchOptions:
    """How to start one sandbox's processes (everything the launcher needs besides paths)."""

    template: SandboxImage
    tools: Path
    allow_internet: bool
    default_limits: tuple[int, int, int]  # cpu_count, memory_mb, pids
    debug_log: bool = False
    hostname: str = "aenv"
    # A pool launch's cgroups get the lowest CPU weight, so a refill never slows live sandboxes. Its
    # processes are not niced: a nice weighs a task only against the tasks of its own cgroup (all of
    # this sandbox's, at one nice), and every hand-out had to undo it thread by thread on the create's
    # path (0.2 ms alone, up to 8 ms during another team's burst).
    pooled: bool = False
    zygote: Zygote | None = None  # fork-server for fast starts; None = exec the launcher
    # Snapshot layers (``<snapshot>/upper`` dirs) stacked over the template's lowers, top first.
    # A sandbox started from a snapshot runs on them; see ``snapshot.py``.
    snapshot_layers: tuple[str, ...] = ()
    # Disk quota: the root is made a subvolume limited to ``disk_mb`` before upper/work exist.
    disk: DiskQuota | None = None
    disk_mb: int = 0
    # The user namespace to run in (``userns.py``); None = host uid 0 in the other namespaces.
    userns: SharedUserns | None = None
    # E2B volumes bound into the root (``launch.bind_volumes``): never a pooled or zygote-less restore.
    volumes: tuple[VolumeBind, ...] = ()
    # KSM may merge the sandbox's pages (``runtime/ksm.py``: the ``ksm`` setting and the API keys)
    mergeable: bool = False
    merge_idle_s: float = 0.0  # ... once idle this long (``envd/mergeable.py``)

    def lowers(self) -> list[str]:
        return [*self.snapshot_layers, *_lowers(self.template)]


def _lowers(template: SandboxImage) -> list[str]:
    return [str(p) for p in (template.lowers or (template.rootfs,))]


def agent_argv(opts: LaunchOptions) -> list[str]:
    t = opts.template
    argv = [
        *launch_argv("/.aenv"), "-m", "aenv.agent",
        "--channel", f"unix-listen:{RUN_MOUNT}/{SOCKET_NAME}",
        "--default-user", t.user or "user",
        "--env-json", json.dumps(t.env),
        "--log", f"{RUN_MOUNT}/{DEBUG_LOG}" if opts.debug_log else "/dev/null",
    ]
    if opts.zygote is None:  # started by exec: CRIU can dump it, so keep it dumpable (criu.py)
        argv.append("--checkpointable")
    if opts.mergeable:
        argv += ["--mergeable", "--merge-idle", str(opts.merge_idle_s)]
    if t.start_cmd:
        argv += ["--start-cmd", t.start_cmd]
        if t.start_user:
            argv += ["--start-user", t.start_user]
        if t.start_cwd:
            argv += ["--start-cwd", t.start_cwd]
    return argv


def _spawn_launcher(cfg: dict[str, Any], userns: SharedUserns | None, fd: int | None) -> Reaped:
    """Plain path: util-linux unshare (stays behind to reap) + the launcher under the host Python; with
    a user namespace the launcher makes the namespaces itself and reaps (``launch.run_in_userns``)."""
    if userns is None or fd is None:
        argv = ["unshare", "--fork", "--pid", "--mount", "--uts", "--ipc", "--net", "--propagation", "private",
                "--", *launcher_mod.host_argv(cfg)]
        return Reaped.spawn(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    cfg = {**cfg, "userns": {"fd": fd, "uid": userns.host_uid}}
    return Reaped.spawn(launcher_mod.host_argv(cfg), pass_fds=(fd,),
                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


def _connect_path(sock: Path) -> tuple[int, str]:
    """Open the socket *file* without following symlinks and connect through /proc/self/fd.

    The run dir is writable from inside the sandbox; if sandbox root replaced ``mux.sock`` with a
    symlink to some host socket, a plain connect() would follow it on the host. O_PATH|O_NOFOLLOW plus
    an S_ISSOCK check pins the connection to the real socket inode the agent made."""
    fd = os.open(sock, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise LaunchError(f"{sock} is not a socket")
    except BaseException:
        os.close(fd)
        raise
    return fd, f"/proc/self/fd/{fd}"


class NsSandbox:
    def __init__(self, name: str, paths: Paths, cgroup: Cgroup, opts: LaunchOptions | None,
                 init: ProcRef | None = None, slirp: Slirp | None = None, keep_root: bool = False) -> None:
        self.name = name  # sandbox ID, or pool-… until hand-out
        self.paths = paths
        self.cgroup = cgroup
        self.opts = opts
        self.init = init
        self.slirp = slirp
        self.allow_internet = bool(opts and opts.allow_internet)
        self.template_id = opts.template.template_id if opts else ""
        # forked from the zygote: CRIU cannot dump it (criu.py); unknown after a restart = assume so
        self.from_zygote = bool(opts and opts.zygote is not None)
        self.nested = bool(opts and opts.template.nested_containers)  # Docker inside (launch.py "nested")
        # A nested sandbox's router (``nested.behind_router``): the launcher, whose network namespace
        # holds the tap and the egress filter. None: those are the init's own.
        self.router: ProcRef | None = None
        # The overlay lowers this sandbox runs on (top first) and how many of them, from the top,
        # are snapshot layers: a snapshot of it records both so a restore can rebuild the stack.
        self.lowers: list[str] = opts.lowers() if opts else []
        self.snapshot_depth = len(opts.snapshot_layers) if opts else 0
        self._stage1: Reaped | None = None
        self._session: MuxSession | None = None
        self._init_stream: ByteStream | None = None  # opened by warm_up for /init
        self._direct: set[DirectStream] = set()  # open connections straight to envd's socket
        self._session_lock = asyncio.Lock()
        self._gate: asyncio.Event | None = None  # set while a dump is prepared: new streams wait for it
        self.egress = HandOutFilter(name)  # a hand-out's policy: streams wait for it (handout.py)
        self._closed = False
        self.last_cpu: tuple[float, int] | None = None
        # The root holds files this sandbox did not make (a start on an existing upper): a teardown
        # removes only what ``aclose(remove_dir=...)`` names.
        self.keep_root = keep_root

    # ---- start ----------------------------------------------------------------------------------
    @classmethod
    async def launch(cls, name: str, root: Path, layout: Layout, opts: LaunchOptions,
                     host_addrs: list[str], timeout: float = 30.0, keep_root: bool = False) -> NsSandbox:
        sbx = cls(name, Paths(root), Cgroup(layout, name), opts, keep_root=keep_root)
        try:
            async with asyncio.timeout(timeout):
                await sbx._start(host_addrs)
        except BaseException:
            await sbx.aclose()
            raise
        return sbx

    async def _start(self, host_addrs: list[str]) -> None:
        opts = self.opts
        assert opts is not None
        cpu, mem, pids = opts.default_limits

        def prepare() -> None:
            if opts.disk is not None:
                opts.disk.make_root(self.paths.root, opts.disk_mb)
            self.paths.prepare()
            self.paths.new_boot_id()
            self.cgroup.create()
            self.cgroup.set_limits(cpu, mem, pids)
            self.cgroup.set_weight(low=opts.pooled)
            if opts.userns is not None:  # the agent makes its sockets here as the sandbox's root
                os.chown(self.paths.run, opts.userns.host_uid, opts.userns.host_uid)

        await asyncio.to_thread(prepare)
        cfg: dict[str, Any] = {
            "merged": str(self.paths.merged), "lowers": self.lowers, "upper": str(self.paths.upper),
            "work": str(self.paths.work), "tools": str(opts.tools), "run": str(self.paths.run),
            "cgroup_procs": self.cgroup.procs_files(), "hostname": opts.hostname,
            "resolv_conf": RESOLV_CONF if opts.allow_internet else None, "boot_id": str(self.paths.boot_id),
            "argv": agent_argv(opts), "env": {}, "log": None,
            "volumes": [[str(v.source), v.path, v.read_only] for v in opts.volumes],
            "nested": opts.template.nested_containers,
        }
        report = await opts.zygote.launch(cfg) if opts.zygote is not None else None
        self.from_zygote = report is not None
        if report is None:
            userns_fd = await asyncio.to_thread(opts.userns.fd) if opts.userns is not None else None
            self._stage1 = _spawn_launcher(cfg, opts.userns, userns_fd)
            assert self._stage1.proc.stdout is not None
            line = await self._stage1.readline()
            self._stage1.proc.stdout.close()
            try:
                report = json.loads(line or b"{}")
            except ValueError:
                report = {"error": f"bad launcher output {line[:200]!r}"}
        if "pid" not in report:
            raise LaunchError(f"sandbox {self.name}: launcher failed: {report.get('error', 'no output')}")
        self.init = ProcRef(int(report["pid"]), int(report["start"]))
        if self.nested and self._stage1 is not None:
            start = proc_start_time(self._stage1.proc.pid)
            if start is None:
                raise LaunchError(f"sandbox {self.name}: its network router ended at start")
            self.router = ProcRef(self._stage1.proc.pid, start)
        self.write_state()
        if opts.allow_internet:
            # filter first: the tap device (and so any route out) only exists once slirp is up
            await ENFORCER.install(self.name, self.net_pid, host_addrs)
            self.slirp = await Slirp.start(self.net_pid, key=self.name)
            fault_point("ns.slirp.started")
            self.write_state()
        await self._connect(wait=True)
        await self.health()

    async def health(self, timeout: float = 60.0) -> None:
        # Under a burst of cold starts envd's imports can take many seconds of contended CPU; the
        # agent holds the stream open until envd listens, and launch()'s own timeout bounds it all.
        status, body = await request(await self.open_stream(ENVD_PORT, timeout), "GET", "/health")
        if status != 204:
            raise EnvdError(f"envd /health answered {status}", status, body)

    async def warm_up(self, user: str = "user") -> None:
        """Run the SDK's first call once (see :func:`warm_up_request`); best effort, never raises."""
        try:
            stream = await self.open_stream(ENVD_PORT)
            try:
                await stream.write(warm_up_request(user))
                while await stream.read(65536):
                    pass
            finally:
                await stream.aclose()
            # Open the stream the hand-out's /init will use now: a stream open is a round trip
            # through agent and envd's accept (~1.3 ms) that a create then does not wait for.
            self._init_stream = await self.open_stream(ENVD_PORT)
        except Exception as exc:  # noqa: BLE001 - a failed warm-up only costs its speed-up
            log.debug("sandbox %s: warm-up failed: %s", self.name, exc)

    async def init_envd(self, payload: dict[str, Any], meanwhile: Callable[[], None] | None = None) -> None:
        """``POST /init``. ``meanwhile`` (blocking host-side work: the pool hand-out) runs after the
        request is written to the pre-opened stream and before its answer is awaited, so envd applies
        /init on the other CPU while the server renames and limits (~1.3 ms off every create)."""
        spare, self._init_stream = self._init_stream, None
        sent = None
        if spare is not None:
            try:
                await send_request(spare, "POST", "/init", payload)
                sent = spare
            except (StreamClosed, OSError) as exc:  # went stale in the pool
                log.debug("sandbox %s: pre-opened init stream failed (%s); opening another", self.name, exc)
                await spare.aclose()
        status: int | None = None
        try:
            if meanwhile is not None:
                meanwhile()  # its errors are the caller's, not a stale stream's
            if sent is not None:
                try:
                    status, body = await read_response(sent)
                except (EnvdError, StreamClosed, OSError) as exc:  # /init is idempotent: resent below
                    log.debug("sandbox %s: pre-opened init stream failed (%s); opening another", self.name, exc)
        finally:
            if sent is not None:
                await sent.aclose()
        if status is None:
            status, body = await request(await self.open_stream(ENVD_PORT), "POST", "/init", payload)
        if status not in (200, 204):
            raise EnvdError(f"envd /init answered {status}", status, body)

    # ---- channel --------------------------------------------------------------------------------
    async def _connect(self, wait: bool = False, timeout: float = 20.0) -> MuxSession:
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while True:
            await self._no_dump()
            try:
                fd, path = _connect_path(self.paths.socket)
                try:
                    session = await open_unix_session(path, name=f"mux-{self.name}")
                finally:
                    os.close(fd)
                if self._gate is not None:  # a dump began while it connected: its quiesce did not see it
                    await session.aclose()
                    continue
                self._session = session
                return session
            except (FileNotFoundError, ConnectionRefusedError):
                if not wait or time.monotonic() > deadline:
                    raise
                if self._stage1 is not None and self._stage1.exited.done():
                    raise LaunchError(f"sandbox {self.name}: init exited during start-up") from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.01)

    async def session(self) -> MuxSession:
        s = self._session
        if s is not None and not s.closed:
            return s
        async with self._session_lock:
            if self._session is None or self._session.closed:
                if self._session is not None:
                    await self._session.aclose()
                await self._connect()
            assert self._session is not None
            return self._session

    async def open_stream(self, port: int, timeout: float = 10.0) -> ByteStream:
        """A stream to ``port`` in the sandbox. envd traffic goes straight to envd's own socket once
        it listens there (see aenv.mux.direct); everything else, and envd while it starts, through
        the agent's mux."""
        await self.egress.ready()  # nothing reaches the sandbox before its policy
        while port == ENVD_PORT:
            await self._no_dump()
            direct = await self._open_direct()
            if direct is None:
                break
            if self._gate is None:
                return direct
            await direct.aclose()  # a dump began while it connected: its quiesce did not see it
        session = await self.session()
        try:
            return await session.open(port, timeout=timeout)
        except StreamClosed:
            if not session.closed:
                raise
            return await (await self.session()).open(port, timeout=timeout)

    async def _no_dump(self) -> None:
        """Return once no dump is being prepared or taken (``quiesce``): no host socket may appear
        meanwhile. The callers connect right after, with nothing awaited in between, and close what
        they connected if a dump began while it was being set up (``quiesce`` closed what it saw)."""
        while (gate := self._gate) is not None:
            await gate.wait()

    async def _open_direct(self) -> DirectStream | None:
        if self._closed:
            return None
        try:
            fd, path = _connect_path(self.paths.run / ENVD_SOCKET)
        except (OSError, LaunchError):  # not there (yet), or not a socket: the mux still works
            return None
        try:
            stream = await open_direct(path, ENVD_PORT)
        except OSError:  # envd restarting: its socket file is left, nobody listens
            return None
        finally:
            os.close(fd)
        self._direct.add(stream)
        stream.on_close(self._direct.discard)
        return stream

    async def drop_connections(self) -> None:
        """End the mux session and every direct envd connection: no idle keep-alive stream may be
        reused into a frozen or dead sandbox (a request would hang instead of getting a 502)."""
        session, self._session = self._session, None
        if session is not None:
            with contextlib.suppress(Exception):
                await session.aclose()
        for stream in list(self._direct):
            await stream.aclose()

    @contextlib.asynccontextmanager
    async def quiesce(self, timeout: float = 5.0) -> AsyncIterator[None]:
        """Hold new streams back and close every host connection until the sandbox holds no socket
        of the host's network namespace and the agent and envd have accepted every connection the
        host closed before they did: what a CRIU dump needs (``checkpoint.py``). In-flight
        requests are cut (envd keeps the processes they started); new ones wait and then proceed."""
        from aenv.runtime.ns.checkpoint import wait_no_host_sockets

        assert self.init is not None
        gate = self._gate = asyncio.Event()
        frozen = False
        try:
            await self.drop_connections()
            # A paused sandbox cannot close its ends: it runs for the few ms that takes.
            frozen = await asyncio.to_thread(self.cgroup.frozen)
            if frozen:
                await asyncio.to_thread(self.cgroup.thaw)
            try:
                await asyncio.to_thread(wait_no_host_sockets, functools.partial(self.cgroup.pids, "pids"),
                                        self.init.pid, timeout, RUN_MOUNT)
            finally:
                if frozen:
                    await asyncio.to_thread(self.cgroup.freeze)
            yield
        finally:
            self._gate = None
            gate.set()

    # ---- hand-out -------------------------------------------------------------------------------
    async def cut_network(self) -> None:
        """No way out any more (slirp4netns stopped): what a sandbox whose policy failed is left with."""
        if self.slirp is not None:
            await self.slirp.aclose()

    def rename(self, new_name: str, new_root: Path) -> None:
        """Give a pooled sandbox its real ID: move its cgroup and directory (blocking, fast)."""
        self.cgroup.rename(new_name)
        new_root.parent.mkdir(parents=True, exist_ok=True)
        os.rename(self.paths.root, new_root)
        self.paths = Paths(new_root)
        self.name = new_name
        self.write_state()

    # ---- state ----------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {
            "kind": "ns",
            "name": self.name,
            "dir": str(self.paths.root),
            "pid": self.init.pid if self.init else None,
            "start": self.init.start if self.init else None,
            "cgroup": self.cgroup.name,
            "slirp": [self.slirp.ref.pid, self.slirp.ref.start] if self.slirp else None,
            "allow_internet": self.allow_internet,
            "template_id": self.template_id,
            "lowers": self.lowers,
            "snapshot_depth": self.snapshot_depth,
            "zygote": self.from_zygote,
            "nested": self.nested,
            "router": [self.router.pid, self.router.start] if self.router else None,
        }

    def write_state(self) -> None:
        tmp = self.paths.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state()))
        os.replace(tmp, self.paths.state_file)

    @classmethod
    def from_state(cls, layout: Layout, data: dict[str, Any]) -> NsSandbox:
        init = ProcRef(int(data["pid"]), int(data["start"])) if data.get("pid") else None
        slirp = Slirp(ProcRef(*data["slirp"])) if data.get("slirp") else None
        sbx = cls(str(data["name"]), Paths(Path(data["dir"])), Cgroup(layout, str(data["cgroup"])), None,
                  init=init, slirp=slirp)
        sbx.allow_internet = bool(data.get("allow_internet"))
        sbx.template_id = str(data.get("template_id", ""))
        sbx.lowers = [str(p) for p in data.get("lowers") or []]
        sbx.snapshot_depth = int(data.get("snapshot_depth") or 0)
        sbx.from_zygote = bool(data.get("zygote", True))
        sbx.nested = bool(data.get("nested"))
        sbx.router = ProcRef(*data["router"]) if data.get("router") else None
        return sbx

    def alive(self) -> bool:
        return self.init is not None and self.init.alive()

    @property
    def net_pid(self) -> int:
        """The process whose network namespace has the tap, the egress filter and the shaping: the
        router of a nested sandbox, else the init."""
        if self.router is not None:
            return self.router.pid
        assert self.init is not None
        return self.init.pid

    # ---- teardown -------------------------------------------------------------------------------
    async def aclose(self, remove_dir: Path | None = None) -> None:
        """Kill everything and remove every trace. Idempotent; completes even if cancelled."""
        if self._closed:
            return
        self._closed = True
        await asyncio.shield(self.egress.settled())
        await asyncio.shield(self._teardown(remove_dir))

    async def stop(self) -> None:
        """Kill every process and remove the cgroup but keep the directory (upper, work, run): the
        first half of a rollback, which relaunches under the same name. Completes under cancellation;
        the object is closed afterwards (a new ``NsSandbox`` takes over the name)."""
        if self._closed:
            return
        self._closed = True
        await asyncio.shield(self._stop_processes(remove_cgroup=True))

    async def _teardown(self, remove_dir: Path | None) -> None:
        await self._stop_processes(remove_cgroup=False)
        await asyncio.to_thread(self._remove_files, remove_dir)

    async def _stop_processes(self, remove_cgroup: bool) -> None:
        await self.drop_connections()
        await self.egress.aclose()
        if self.init is not None:
            self.init.kill()  # SIGKILL of a pid-ns init takes the whole namespace with it
        if self._stage1 is not None and self.init is None:
            self._stage1.kill()  # start-up failed before the init reported itself
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.cgroup.kill_all)
        if self.init is not None:
            await self.init.wait_gone_async(5.0)
        if self._stage1 is not None:
            await self._stage1.aclose()
        if self.slirp is not None:
            with contextlib.suppress(Exception):
                await self.slirp.aclose()
        elif self.opts is None and self.init is not None:
            # rebuilt from ns.json after a crash: a slirp may run that ns.json never recorded
            await asyncio.to_thread(kill_slirps_serving, {self.net_pid})
        if remove_cgroup:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.cgroup.remove)

    def _remove_files(self, remove_dir: Path | None) -> None:
        keep = os.environ.get("AENV_NS_KEEP_LOGS")  # debugging aid: copy the run dir's logs first
        if keep and self.paths.run.is_dir():
            shutil.copytree(self.paths.run, Path(keep) / self.name, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("*.sock"))
        with contextlib.suppress(Exception):
            self.cgroup.remove()
        for d in (None if self.keep_root else self.paths.root, remove_dir):
            if d is not None:
                remove_tree(d)  # a quota subvolume goes at once, whatever its size

"""Probes for what a server may leave behind on the host, and a server handle the tests can crash.

Leaks are judged per server, by its state directory: the ``aenv/`` cgroup parent and ``/proc`` are
shared with every other server on the host (other test sessions run beside this one), so a probe only
counts what provably belongs to *this* state dir or to sandbox IDs this test created.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from aenv.config import VOLUMES_NAME
from aenv.runtime.ns.disk import IMAGE_NAME, POOL_NAME, loop_device_for
from aenv.testing.server import (
    API_KEY,
    Server,
    discard_vm_state,
    release_ns_volume,
    start_server,
    stop_server,
)

CGROUP_ROOT = Path("/sys/fs/cgroup")
SERVER_DIRS = {POOL_NAME, VOLUMES_NAME}  # what a server keeps under sandboxes/ for itself, never a leak
HEADERS = {"X-API-KEY": API_KEY}


def sdk_kwargs(server: Server) -> dict[str, str]:
    """Per-call SDK connection options: several servers live at once, so no global env."""
    return {"api_url": server.url, "sandbox_url": server.url, "api_key": API_KEY}


def api(server: Server, timeout: float = 30.0) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers=HEADERS, timeout=timeout, trust_env=False)


def wait_dead(server: Server, timeout: float = 30.0) -> int:
    """Wait for the server process to exit; return its raw status (negative = killed by signal)."""
    return server.proc.wait(timeout=timeout)


# ---- what the host holds for a state dir --------------------------------------------------------
def aenv_cgroup_dirs() -> dict[str, list[Path]]:
    """Every sandbox cgroup directory on the host, by name: ``<hierarchy>/aenv/<scope>/<name>`` (one
    scope per state dir) and the older unscoped ``<hierarchy>/aenv/<name>``. A directory counts as a
    sandbox cgroup when it holds no sub-cgroups of its own (scope directories do)."""
    out: dict[str, list[Path]] = {}
    for parent in [*CGROUP_ROOT.glob("*/aenv"), CGROUP_ROOT / "aenv"]:  # v1 hierarchies, v2 unified
        with contextlib.suppress(OSError):
            for d in parent.iterdir():
                if not d.is_dir():
                    continue
                subs = [x for x in d.iterdir() if x.is_dir()]
                if subs and not d.name.startswith("pool-"):
                    for x in subs:
                        out.setdefault(x.name, []).append(x)
                else:
                    out.setdefault(d.name, []).append(d)
    return out


_CG_NAME = re.compile(r"/aenv/(?:[^/\n]+/)*([^/\n]+)$", re.MULTILINE)


def cgroup_names_of(pid: int) -> set[str]:
    """The leaf names of the aenv cgroups ``pid`` is in (its sandbox ID or pool name)."""
    try:
        return set(_CG_NAME.findall(Path(f"/proc/{pid}/cgroup").read_text()))
    except OSError:
        return set()


def _cgroup_members(dirs: Iterable[Path]) -> set[int]:
    pids: set[int] = set()
    for d in dirs:
        with contextlib.suppress(OSError, ValueError):
            pids.update(int(x) for x in (d / "cgroup.procs").read_text().split())
    return pids


def _upper_under(pid: int, state_dir: Path) -> bool:
    with contextlib.suppress(OSError):
        return f"upperdir={state_dir.resolve()}/" in Path(f"/proc/{pid}/mountinfo").read_text()
    return False


def cgroups_of(state_dir: Path, ids: Iterable[str] = ()) -> set[str]:
    """Cgroup names that belong to this state dir: named after one of ``ids``, or with a member
    whose root overlay lives under ``state_dir``."""
    wanted = set(ids)
    out: set[str] = set()
    for name, dirs in aenv_cgroup_dirs().items():
        if name in wanted or any(_upper_under(p, state_dir) for p in _cgroup_members(dirs)):
            out.add(name)
    return out


def processes_of(state_dir: Path, ids: Iterable[str]) -> dict[int, str]:
    """Host processes that belong to these sandboxes or this state dir: in an ``aenv/<id>`` cgroup,
    with the state dir or an ID on their command line, or rooted on an overlay under the state dir."""
    wanted = set(ids)
    state = str(state_dir.resolve())
    out: dict[int, str] = {}
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cg = (entry / "cgroup").read_text()
        except OSError:
            continue
        if not cmd:
            continue  # kernel thread or zombie
        cg_names = set(_CG_NAME.findall(cg))
        if (
            cg_names & wanted
            or any(i in cmd for i in wanted)
            or (state in cmd and "aenv.cli.main serve" not in cmd)
            or (cg_names and _upper_under(pid, state_dir))
        ):
            out[pid] = cmd[:200]
    return out


def mounts_under(path: Path) -> list[str]:
    """Host mounts (in the test's own mount namespace) at or below ``path``, except the ns
    runtime's sandboxes volume (``<state>/sandboxes``, see ``aenv.runtime.ns.disk``): it is the
    state dir's storage while a server runs, not a sandbox's leftover. Servers unmount it when they
    stop; ``ServerFactory.close`` makes sure."""
    p = str(path.resolve())
    volume = f" {p}/sandboxes "
    with open("/proc/self/mountinfo") as fh:
        return [line.strip() for line in fh if (f" {p}/" in line or f" {p} " in line) and volume not in line]


def pool_dirs(state_dir: Path) -> list[Path]:
    """Where a server keeps its warm pool (now on the sandboxes volume; formerly ``<state>/ns-pool``)."""
    return [state_dir / "sandboxes" / POOL_NAME, state_dir / "ns-pool"]


def vm_pool_names(state_dir: Path) -> set[str]:
    """The vm runtime's warm and spawned-ahead QEMUs (``pool-*`` run dirs). A restarted server's
    reconcile removes the run dirs of the QEMUs it does not own, so those present are its own."""
    from aenv.runtime.vm.runtime import _short_run_root

    run_root = _short_run_root(state_dir / "vm" / "run")
    return {d.name for d in run_root.glob("pool-*")} if run_root.is_dir() else set()


def slirps_with_dead_target(parents: set[int] | None = None) -> set[int]:
    """slirp4netns processes whose sandbox (the PID they serve) is gone. With ``parents``, only those
    whose parent is one of them or PID 1 (orphaned by a dead server): other servers on the host stop a
    sandbox's init a moment before its slirp, and that window is not our leak."""
    out: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        zombie, ppid = fields[0] == "Z", int(fields[1])
        # zombies hold no resources: this container's PID 1 does not reap orphans
        if zombie or not argv or not argv[0].endswith(b"slirp4netns"):
            continue
        if parents is not None and ppid not in parents | {1}:
            continue
        nums = [a for a in argv[1:] if a.isdigit()]
        if nums and not _alive(int(nums[-1])):
            out.add(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    """Running, not a zombie (a killed init lingers as one until its parent reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def orphan_slirps(before: set[int], parents: set[int], settle: float = 10.0) -> set[int]:
    """New orphaned slirp4netns processes that stay orphaned for ``settle`` seconds."""
    deadline = time.monotonic() + settle
    while True:
        found = slirps_with_dead_target(parents) - before
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


@dataclass
class Leaks:
    processes: dict[int, str] = field(default_factory=dict)
    cgroups: set[str] = field(default_factory=set)
    mounts: list[str] = field(default_factory=list)
    dirs: set[str] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.processes or self.cgroups or self.mounts or self.dirs)


def leaks(state_dir: Path, dead_ids: Iterable[str], live_ids: Iterable[str] = (), settle: float = 10.0) -> Leaks:
    """What is still on the host for ``dead_ids`` or not accounted for by ``live_ids`` (plus the
    server's current warm pool). Polls up to ``settle`` seconds: teardown is asynchronous."""
    dead, live = set(dead_ids), set(live_ids)
    deadline = time.monotonic() + settle
    while True:
        pool = {d.name for pd in pool_dirs(state_dir) if pd.is_dir() for d in pd.glob("*")} | vm_pool_names(state_dir)
        allowed = live | pool
        found = Leaks(
            processes={
                pid: cmd for pid, cmd in processes_of(state_dir, dead).items() if not any(i in cmd for i in allowed)
            },
            cgroups=cgroups_of(state_dir, dead) - allowed,
            mounts=mounts_under(state_dir),
            dirs={d.name for d in (state_dir / "sandboxes").glob("*") if d.name not in SERVER_DIRS} - live
            if (state_dir / "sandboxes").is_dir() else set(),
        )
        # live sandboxes' processes match by overlay or state path (their launcher): keep only the rest
        found.processes = {pid: cmd for pid, cmd in found.processes.items() if not _owned_by(pid, allowed)}
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def _owned_by(pid: int, names: set[str]) -> bool:
    """In one of the ``names`` cgroups, or the parent of such a process (a sandbox's stage-1
    ``unshare`` stays outside the cgroup it puts the sandbox's init into)."""
    try:
        children = [int(c) for t in Path(f"/proc/{pid}/task").iterdir()
                    for c in (t / "children").read_text().split()]
    except (OSError, ValueError):
        return True  # gone meanwhile: not a leak
    if cgroup_names_of(pid) & names:
        return True
    return any(_owned_by(c, names) for c in children)


# ---- server lifecycle for tests that crash it -------------------------------------------------
class ServerFactory:
    """Starts servers in one temp dir (so a restart reuses the state) and guarantees no strays:
    at teardown every sandbox of that state dir is killed by a clean server and the server stopped."""

    def __init__(self, tmp: Path, runtime: str, base_env: dict[str, str] | None = None) -> None:
        self.tmp = tmp
        self.runtime = runtime
        self.base_env = dict(base_env or {})
        self.servers: list[Server] = []
        self.port: int | None = None

    @property
    def state_dir(self) -> Path:
        return self.tmp / "state"

    def start(self, faults: str = "", extra_env: dict[str, str] | None = None) -> Server:
        self.tmp.mkdir(parents=True, exist_ok=True)
        env = {**self.base_env, "AENV_FAULTS": faults, **(extra_env or {})}
        srv = start_server(self.tmp, self.runtime, env)
        self.servers.append(srv)
        return srv

    def sigkill(self, server: Server) -> None:
        """What the OOM killer does: SIGKILL the server process only (its sandboxes keep running)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=30)

    def close(self) -> None:
        for srv in self.servers:
            if srv.proc.poll() is None:
                _kill_all_sandboxes(srv)
                stop_server(srv)
        if loop_device_for(self.state_dir / IMAGE_NAME) is not None or any(
                d.is_dir() and any(x for x in d.iterdir() if x.name not in SERVER_DIRS or any(x.iterdir()))
                for d in (self.state_dir / "sandboxes", *pool_dirs(self.state_dir))):
            # (an attached ns volume that is not mounted is held by sandboxes still running)
            # Something survived a crash the test did not clean up: a clean server reconciles it.
            with contextlib.suppress(Exception):
                srv = start_server(self.tmp, self.runtime, {**self.base_env, "AENV_FAULTS": "", "AENV_POOL_SIZE": "0"})
                _kill_all_sandboxes(srv)
                stop_server(srv)
        release_ns_volume(self.state_dir)  # a SIGKILLed server's volume, if nothing reconciled it
        # vm: QEMUs outlive a server on purpose (the next one adopts them); none comes after this, so
        # a VM no listing showed (a create still in flight at the stop) goes now, with its RAM dir
        discard_vm_state(self.state_dir)
        volume = f" {(self.state_dir / 'sandboxes').resolve()} "
        with open("/proc/self/mountinfo") as fh:
            assert not any(volume in line for line in fh), f"the ns volume of {self.state_dir} is still mounted"


def _kill_all_sandboxes(srv: Server) -> None:
    with contextlib.suppress(Exception), api(srv) as c:
        for sid in list_ids(c):
            c.delete(f"/sandboxes/{sid}")


def list_ids(c: httpx.Client) -> dict[str, str]:
    """Every sandbox the server lists (id -> state), following the pagination tokens."""
    out: dict[str, str] = {}
    params: dict[str, str | int] = {"state": "running,paused", "limit": 100}
    while True:
        resp = c.get("/v2/sandboxes", params=params)
        resp.raise_for_status()
        out.update({s["sandboxID"]: s["state"] for s in resp.json()})
        token = resp.headers.get("X-Next-Token")
        if not token:
            return out
        params["nextToken"] = token


def run_quiet(argv: list[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=False).stdout

"""CRIU dump and restore of one ns sandbox's process tree (blocking helpers; callers run them in threads).

``criu.py`` builds the command lines; this module runs them against a real sandbox and turns CRIU's
failures into reasons a client can read (the ``Error`` lines of ``dump.log`` / ``restore.log``: which
process, which file or socket). What a dump needs from the sandbox beyond ``criu.py``'s externals:

* no socket of the host's network namespace in any process (``host_sockets``): the server's own
  connections to the agent and envd are such sockets, so the host closes its ends first and waits
  for the sandbox to close the others (``NsSandbox.quiesce``);
* a consistent tree: the cgroup is frozen around the dump and the copy of the upper.

A restore runs CRIU in a fresh network namespace (``criu.in_fresh_netns_argv``) and inside the new
sandbox's cgroups (``criu.in_cgroups_argv``), on an overlay mounted on the host only for the restore.
A sandbox in a user namespace (``userns.py``) is dumped and restored differently: ``dump(userns=True)``
and ``restore_in_userns`` say how and why.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from aenv.agent import launch
from aenv.runtime.network import SLIRP_GATEWAY
from aenv.runtime.ns import criu
from aenv.runtime.ns.userns import SharedUserns

DUMP_LOG = "dump.log"
RESTORE_LOG = "restore.log"
_NET_TABLES = ("unix", "tcp", "tcp6", "udp", "udp6", "raw", "raw6", "netlink", "packet", "udplite", "udplite6")
_SOCKET = re.compile(r"socket:\[(\d+)\]")
_libc = ctypes.CDLL(None, use_errno=True)
_MNT_DETACH = 2
# Logged on every run because CAP_SYS_RESOURCE is missing for criu's own rlimit: not a failure.
_NOISE = ("RLIMIT_NOFILE",)


class CheckpointError(Exception):
    """A dump or restore that failed, with the reason taken from CRIU's log."""


def net_inode(pid: int) -> int:
    """The inode of ``pid``'s network namespace (what ``--external net[...]`` names)."""
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def _netns_sockets(pid: int) -> set[int]:
    """Every socket inode of ``pid``'s network namespace, from its /proc/<pid>/net tables."""
    out: set[int] = set()
    for table in _NET_TABLES:
        try:
            with open(f"/proc/{pid}/net/{table}") as fh:
                lines = fh.read().splitlines()[1:]
        except OSError:
            continue
        col = 6 if table == "unix" else (5 if table == "packet" else (8 if table == "netlink" else 9))
        for line in lines:
            parts = line.split()
            if len(parts) > col and parts[col].isdigit():
                out.add(int(parts[col]))
    return out


def host_sockets(pids: list[int], init_pid: int) -> list[tuple[int, int]]:
    """(pid, inode) of each socket held by ``pids`` that is not of the sandbox's network namespace."""
    inside = _netns_sockets(init_pid)
    found: list[tuple[int, int]] = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                m = _SOCKET.fullmatch(os.readlink(f"/proc/{pid}/fd/{fd}"))
                if m and int(m.group(1)) not in inside:
                    found.append((pid, int(m.group(1))))
    return found


def wait_no_host_sockets(pids: Callable[[], list[int]], init_pid: int, timeout: float) -> None:
    """Wait until no process of the sandbox holds a host socket (they close their ends after ours)."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        left = host_sockets(pids(), init_pid)
        if not left:
            return
        if time.monotonic() > deadline:
            raise CheckpointError(f"processes still hold connections to the host ({len(left)} sockets, e.g. "
                                  f"pid {left[0][0]} socket {left[0][1]}); cannot dump them")
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


def reason(log: Path, limit: int = 3) -> str:
    """The last meaningful ``Error`` lines of a CRIU log, short enough for an API message."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {log})"
    errors = [ln.split("): ", 1)[-1].strip() for ln in lines
              if "Error (" in ln and not any(n in ln for n in _NOISE)]
    errors = [e for e in errors if e and not e.startswith(("Dumping FAILED", "Restoring FAILED"))]
    return "; ".join(errors[-limit:]) if errors else (lines[-1].strip() if lines else "no reason logged")


def run_criu(argv: list[str], log: Path, what: str, pass_fds: tuple[int, ...] = ()) -> None:
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False,
                          pass_fds=pass_fds)
    if proc.returncode != 0:
        why = reason(log) if log.exists() else ((proc.stderr + proc.stdout).strip()[-400:] or f"exit {proc.returncode}")
        raise CheckpointError(f"criu {what} failed: {why}")


def kdat_cache(exe: str) -> Path | None:
    """The directory that keeps CRIU's kernel probe between runs (``criu.in_kdat_cache_argv``), made
    on first use; None where it cannot be (no /dev/shm): CRIU then probes every time, as before."""
    path = criu.kdat_dir(exe)
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        # CRIU creates the cache with O_EXCL on "<file>.tmp" and a failed save leaves that file
        # behind, blocking every later save: a leftover is never fresher than a missing cache.
        with contextlib.suppress(FileNotFoundError):
            if time.time() - (path / "criu.kdat.tmp").stat().st_mtime > 60:
                (path / "criu.kdat.tmp").unlink()
    except OSError:
        return None
    return path


def dump(exe: str, init_pid: int, images: Path, *, freezer: Path | None, leave_running: bool = True,
         userns: bool = False) -> None:
    """``criu dump`` of the tree rooted at ``init_pid`` into ``images``, its network namespace external.
    ``userns``: a sandbox in a user namespace; its network namespace is dumped (a restored tree is
    cloned into a new user namespace first and may not join one made outside it) and /dev is external
    (CRIU would tar the tmpfs with the device nodes bound over it: its clean view needs a directory it
    makes as host uid 0 in the sandbox's /tmp, which the idmapped upper refuses; a restore inside the
    user namespace could not mknod them either)."""
    images.mkdir(parents=True, exist_ok=True)
    argv = criu.dump_argv(exe, init_pid, images, freezer=freezer, log=DUMP_LOG, leave_running=leave_running,
                          net_inode=None if userns else net_inode(init_pid), dev_external=userns)
    with _tap_set_aside(init_pid, back=leave_running) if userns else contextlib.nullcontext():
        run_criu(criu.in_kdat_cache_argv(kdat_cache(exe), argv), images / DUMP_LOG, "dump")


TAP = "tap0"  # what slirp4netns makes in an internet sandbox (runtime/network.py)
TAP_ADDR = "10.0.2.100/24"  # and how it configures it (slirp4netns --configure)


def _ip(pid: int, *args: str) -> None:
    subprocess.run(["nsenter", "-t", str(pid), "-n", "ip", *args], check=True, capture_output=True)


@contextlib.contextmanager
def _tap_set_aside(init_pid: int, back: bool) -> Iterator[None]:
    """An internet sandbox's tap out of its network namespace while CRIU dumps that (the tap's fd is
    slirp4netns's, so CRIU cannot dump it), then (``back``: the tree runs on) back with slirp4netns's
    configuration: moved, slirp keeps its fd; otherwise deleted. Aside it sits down and without an
    address in the server's namespace under a name of its own; the sandbox is frozen meanwhile. Each
    restore gets a tap of its own from a new slirp4netns (``NsRuntime.attach_restored``)."""
    with open(f"/proc/{init_pid}/net/dev") as fh:
        has_tap = any(line.split(":", 1)[0].strip() == TAP for line in fh.read().splitlines()[2:])
    if not has_tap:
        yield
        return
    aside = f"aenv{init_pid:x}"[:15]
    _ip(init_pid, "link", "set", TAP, "netns", str(os.getpid()), "name", aside)
    try:
        yield
    finally:
        if not back or not os.path.exists(f"/proc/{init_pid}"):
            _ip(os.getpid(), "link", "del", aside)
        else:
            _ip(os.getpid(), "link", "set", aside, "netns", str(init_pid), "name", TAP)
            _ip(init_pid, "addr", "add", TAP_ADDR, "dev", TAP)
            _ip(init_pid, "link", "set", TAP, "up")
            _ip(init_pid, "route", "add", "default", "via", SLIRP_GATEWAY, "dev", TAP)


def restore(exe: str, images: Path, *, lowers: list[str], upper: Path, work: Path, merged: Path, run_dir: Path,
            tools: Path, boot_id: Path, procs_files: list[str], userns: SharedUserns | None = None) -> int:
    """``criu restore`` into a fresh network namespace and the given cgroups; returns the restored
    init's host pid. The overlay is mounted on the host only while CRIU runs (the restored tree keeps
    its own copy in its mount namespace). ``userns``: see ``restore_in_userns``."""
    pidfile = run_dir / "criu-restore.pid"
    log = run_dir / RESTORE_LOG
    if userns is not None:
        return restore_in_userns(exe, images, userns, lowers=lowers, upper=upper, work=work, merged=merged,
                                 run_dir=run_dir, tools=tools, boot_id=boot_id, procs_files=procs_files)
    mount_overlay(criu.overlay_options(lowers, upper, work), merged)
    try:
        run_criu(criu.in_cgroups_argv(procs_files, criu.in_fresh_netns_argv(criu.restore_argv(
            exe, images, root=merged, pidfile=pidfile, tools=tools, run_dir=run_dir, log=str(log),
            boot_id=boot_id), kdat=kdat_cache(exe))), log, "restore")
    finally:
        _libc.umount2(os.fsencode(merged), _MNT_DETACH)  # the restored tree holds its own copy
    return int(pidfile.read_text().strip())


def mount_overlay(options: str, target: Path) -> None:
    """mount(2) of an overlay at ``target`` (what ``mount -t overlay`` does, without its exec)."""
    if _libc.mount(b"overlay", os.fsencode(target), b"overlay", 0, options.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount overlay at {target}: {os.strerror(err)}")


def restore_in_userns(exe: str, images: Path, userns: SharedUserns, *, lowers: list[str], upper: Path,
                      work: Path, merged: Path, run_dir: Path, tools: Path, boot_id: Path,
                      procs_files: list[str]) -> int:
    """``restore`` of a user-namespaced sandbox's images (``dump(userns=True)``): CRIU makes the user
    namespace again from the dumped map and the network namespace inside it; the launcher
    (``launch.restore_root``) mounts the overlay over idmapped layers and a fresh /dev in a private
    mount namespace and execs CRIU there, so nothing is mounted on the host."""
    pidfile = run_dir / "criu-restore.pid"
    log = run_dir / RESTORE_LOG
    os.chown(run_dir, userns.host_uid, userns.host_uid)  # restored sockets are bound there from inside
    fd = userns.fd()
    stage = Path(tempfile.mkdtemp(prefix="aenv-restore-", dir=criu.KDAT_BASE))  # a tmpfs every uid can walk
    stage.chmod(0o755)
    argv = criu.restore_argv(exe, images, root=merged, pidfile=pidfile, tools=stage / "tools", run_dir=stage / "run",
                             log=str(log), boot_id=stage / "boot_id", net_external=False, dev=stage / "dev")
    cfg = {"restore_root": True, "userns": {"fd": fd, "uid": userns.host_uid}, "lowers": lowers,
           "upper": str(upper), "work": str(work), "merged": str(merged), "argv": argv,
           "stage_dir": str(stage), "stage": {"tools": str(tools), "run": str(run_dir), "boot_id": str(boot_id)}}
    helper = [sys.executable, "-I", "-S", launch.__file__, json.dumps(cfg)]
    try:
        run_criu(criu.in_cgroups_argv(procs_files, criu.in_kdat_cache_argv(kdat_cache(exe), helper)), log,
                 "restore", pass_fds=(fd,))
    finally:
        stage.rmdir()  # its mounts were in the helper's namespace only
    return int(pidfile.read_text().strip())

"""CRIU dump and restore of one ns sandbox's process tree (blocking helpers; callers run them in threads).

``criu.py`` builds the command lines; this module runs them against a real sandbox and turns CRIU's
failures into reasons a client can read (the ``Error`` lines of ``dump.log`` / ``restore.log``: which
process, which file or socket). What a dump needs from the sandbox beyond ``criu.py``'s externals:

* no socket of the host's network namespace in any process (``host_sockets``, ``sockets.py``): the server's own
  connections to the agent and envd are such sockets, so the host closes its ends first and waits
  for the sandbox to close the others (``NsSandbox.quiesce``), and for the agent and envd to accept
  those still queued on their listening sockets (``wait_no_host_sockets``);
* a consistent tree: the cgroup is frozen around the dump and the copy of the upper.

A restore runs CRIU in a fresh network namespace and a private mount namespace where the sources of
the host binds are read-only (``criu.in_fresh_netns_argv``), inside the new sandbox's cgroups
(``criu.in_cgroups_argv``), on an overlay mounted on the host only for the restore.
A sandbox in a user namespace (``userns.py``) is dumped and restored differently (its images are
marked ``USERNS_MARK``): ``dump`` and ``restore_in_userns`` say how and why.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from aenv.agent import launch
from aenv.runtime.base import VolumeBind
from aenv.runtime.ns import criu, sockets, tmpfs_tar
from aenv.runtime.ns.lazypages import lazy_restore
from aenv.runtime.ns.userns import SharedUserns, mapped_base
from aenv.runtime.nsthread import in_private_mounts, run_in_namespace

_log = logging.getLogger("aenv.runtime.ns")
DUMP_LOG = "dump.log"
RESTORE_LOG = "restore.log"
DEBUG_LOG = "agent.log"  # in /.aenv-run, with log_level = debug (sandbox.agent_argv)
_libc = ctypes.CDLL(None, use_errno=True)
_MNT_DETACH = 2
# Logged on every run because CAP_SYS_RESOURCE is missing for criu's own rlimit: not a failure.
_NOISE = ("RLIMIT_NOFILE",)


class CheckpointError(Exception):
    """A dump or restore that failed, with the reason taken from CRIU's log."""


def host_sockets(pids: list[int], init_pid: int, seen: dict[str, set[int]] | None = None) -> list[tuple[int, int]]:
    """(pid, inode) of each socket held by ``pids`` that is not of the sandbox's network namespace
    (that of ``init_pid``), each socket asked for its namespace (``sockets.py``). ``seen`` (kept
    across the calls of one wait): a socket never changes namespace, so each is asked once."""
    seen = {"inside": set(), "outside": set()} if seen is None else seen
    ours = os.stat(f"/proc/{init_pid}/ns/net").st_ino
    left: list[tuple[int, int]] = []
    for pid, fd, inode in sockets.held_sockets(pids):
        if inode not in seen["inside"] and inode not in seen["outside"]:
            ns = sockets.netns_inode(pid, fd)
            if ns is None:  # closed meanwhile
                continue
            seen["inside" if ns == ours else "outside"].add(inode)
        if inode in seen["outside"]:
            left.append((pid, inode))
    return left


def wait_no_host_sockets(pids: Callable[[], list[int]], init_pid: int, timeout: float,
                         channels: str | None = None) -> None:
    """Wait until no process of the sandbox holds a host socket (they close their ends after ours).
    ``channels``: the sandbox's directory of the listening sockets the host connects to (the agent's
    and envd's); first each of them must have accepted every connection queued on it. A connection
    the host closed before it was accepted stays queued, and CRIU cannot dump a listener holding
    one ("Found a closed in-flight socket"); accepted, it is a host socket until its process sees
    the end and closes it. The queues are read before the sockets held, so one accepted between the
    two reads is seen held."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    seen: dict[str, set[int]] = {"inside": set(), "outside": set()}
    listeners = sockets.unix_listeners(pids(), channels) if channels is not None else []
    while True:
        queued = [listener for listener in listeners if sockets.has_queued(*listener)]
        left = [] if queued else host_sockets(pids(), init_pid, seen)
        if not queued and not left:
            return
        if time.monotonic() > deadline:
            if queued:
                raise CheckpointError(f"connections from the host wait to be accepted on a socket of pid "
                                      f"{queued[0][0]} (fd {queued[0][1]}); cannot dump them")
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


CRIU_TIMEOUT = 120.0  # s: a dump or restore still running then is stuck (a task it holds was killed), not slow


def run_criu(argv: list[str], log: Path, what: str, on_ready: Callable[[int], None] | None = None,
             mounts: Callable[[], None] | None = None, env: dict[str, str] | None = None) -> None:
    """Run CRIU (``argv``: CRIU behind its wrappers). ``on_ready``: called with the wrapper's pid once
    it prints ``criu.READY`` (its namespaces made; it waits for our go-ahead on stdin, then CRIU
    starts in the same process); if the call fails, CRIU is killed and the call's error raised.
    ``mounts``: made in a private mount namespace CRIU is spawned into (``nsthread.in_private_mounts``;
    ``restore_in_userns``); an error there is raised as it is, CRIU never started. ``env``: CRIU's
    environment (a dump's or a restore's: ``tmpfs_tar.criu_env``), else the server's."""
    stdin = subprocess.PIPE if on_ready is not None else subprocess.DEVNULL

    def spawn() -> subprocess.Popen[str]:
        return subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env)

    proc = spawn() if mounts is None else in_private_mounts(mounts, spawn, thread_name="aenv-criu-mounts")
    try:
        if on_ready is not None:
            assert proc.stdout is not None and proc.stdin is not None
            if proc.stdout.readline().strip() == criu.READY:  # else the wrapper failed: its exit says why
                on_ready(proc.pid)  # the wrapper waits meanwhile: its pid is its namespace's
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.write("go\n")
                proc.stdin.close()
            proc.stdin = None  # communicate() must not touch it again
        try:
            out, err = proc.communicate(timeout=CRIU_TIMEOUT)
        except subprocess.TimeoutExpired as exc:
            raise CheckpointError(f"criu {what} did not finish in {CRIU_TIMEOUT:g} s (killed)") from exc
    except BaseException:
        proc.kill()
        proc.wait()  # not communicate(): a half-restored task may hold the pipes (its cgroup's teardown ends it)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                with contextlib.suppress(BrokenPipeError):
                    pipe.close()
        raise
    if proc.returncode != 0:
        why = reason(log) if log.exists() else ((err.strip() or out.strip())[-400:] or f"exit {proc.returncode}")
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


USERNS_MARK = "aenv-userns"  # in a dump of a user-namespaced tree: the host uid its root is


def dumped_userns(images: Path) -> int | None:
    """The host uid of the root of the user namespace ``images`` were dumped in (0: one, base
    unrecorded), or None: dumped in the host's own."""
    try:
        return int((images / USERNS_MARK).read_text())
    except FileNotFoundError:
        return 0 if any(images.glob("userns-*.img")) else None


def dump(exe: str, init_pid: int, images: Path, *, freezer: Path | None, leave_running: bool = True,
         volumes: Sequence[str] = (), run_dir: Path | None = None) -> None:
    """``criu dump`` of the tree rooted at ``init_pid`` into ``images``, CRIU run in the tree's own
    network namespace (``criu.in_netns_of_argv``): the namespace is then not one to dump at all.
    Whether the tree runs in a user namespace is read from its uid map, not from the server's
    setting: a sandbox adopted after the setting changed keeps the mode it was started in, and
    its images say which (``USERNS_MARK``; ``restore`` follows them).
    In a user namespace its network namespace is dumped as an empty one (its sockets only:
    ``dump_argv(empty_net=True)``; the tap slirp4netns holds stays where it is), CRIU run in the
    server's (a restored tree is cloned into a new user namespace first and may not join one made
    outside it, so a restore cannot put it in CRIU's), and /dev is external (CRIU would tar the tmpfs
    with the device nodes bound over it: its clean view needs a directory it makes as host uid 0 in
    the sandbox's /tmp, which the idmapped upper refuses; a restore inside the user namespace could
    not mknod them either). ``volumes``: the mount points of its E2B volumes (external).
    ``run_dir``: the sandbox's ``/.aenv-run``, for its debug log (``keep_debug_log``); the tree must
    be frozen then."""
    images.mkdir(parents=True, exist_ok=True)
    if run_dir is not None:
        keep_debug_log(run_dir, images)
    if sockets.has_outside_tcp(sockets.tree_pids(init_pid)):  # read while frozen: no socket gains a peer
        (images / criu.OUTSIDE_TCP_MARK).touch()
    base = mapped_base(init_pid)
    mounts, env = _kdat_mount(kdat_cache(exe)), tmpfs_tar.criu_env(criu.KDAT_BASE)
    if base is not None:
        (images / USERNS_MARK).write_text(str(base))
        argv = criu.dump_argv(exe, init_pid, images, freezer=freezer, log=DUMP_LOG, leave_running=leave_running,
                              dev_external=True, volumes=volumes, empty_net=True)
        run_criu(argv, images / DUMP_LOG, "dump", mounts=mounts, env=env)
        return
    argv = criu.dump_argv(exe, init_pid, images, freezer=freezer, log=DUMP_LOG, leave_running=leave_running,
                          volumes=volumes)
    run_criu(criu.in_netns_of_argv(init_pid, argv), images / DUMP_LOG, "dump", mounts=mounts, env=env)


def _kdat_mount(kdat: Path | None) -> Callable[[], None] | None:
    """What ``criu.in_kdat_cache_argv`` does (CRIU's ``/run`` bound to its probe cache), as ``run_criu``'s
    ``mounts``: made on a thread of its own mount namespace that then spawns CRIU, not by ``unshare``,
    ``sh`` and ``mount`` execs before it (~3 ms of every dump, the sandbox frozen)."""
    if kdat is None:
        return None
    return lambda: launch.bind(str(kdat), "/run")


def keep_debug_log(run_dir: Path, images: Path) -> None:
    """With ``log_level = debug`` the agent, envd and the start command keep ``/.aenv-run/agent.log``
    open. That mount is external: a restore maps it to the new sandbox's run dir, where CRIU must
    find the file at the size it dumped, or it fails ("Can't open file .aenv-run/agent.log"). So the
    (frozen) log is copied beside the images and ``restore`` puts it in place first."""
    with contextlib.suppress(FileNotFoundError):
        _copy_owned(run_dir / DEBUG_LOG, images / DEBUG_LOG)


def _copy_owned(src: Path, dst: Path) -> None:
    """Contents, mode and owner (the sandbox's root, a mapped uid in a user namespace: the restored
    processes open the file as that uid)."""
    shutil.copy2(src, dst)
    st = src.stat()
    os.chown(dst, st.st_uid, st.st_gid)


def _ip(pid: int, *args: str) -> None:
    subprocess.run(["nsenter", "-t", str(pid), "-n", "ip", *args], check=True, capture_output=True)


def end_restore_network(pid: int) -> None:
    """What a restored tree's network namespace allowed only while CRIU restored its sockets, undone
    before the tree gets a network: binding to absent addresses (``criu.NONLOCAL_BIND``: one short
    thread in the namespace of ``pid``, the restored init) and the stand-in address and route
    (``criu.OUTSIDE_TCP_MARK``, seen in the namespace's route table; removed only where they are)."""
    def forbid(_: ctypes.CDLL) -> None:
        try:  # opened in the thread's namespace: the sandbox's value
            with open(criu.NONLOCAL_BIND, "w") as fh:
                fh.write("0")
        except OSError:  # a read-only /proc/sys (a container): then the wrapper could not allow it either
            with open(criu.NONLOCAL_BIND) as fh:
                if fh.read().strip() != "0":
                    raise

    run_in_namespace(pid, "net", forbid, thread_name=f"nonlocal-{pid}")
    with open(f"/proc/{pid}/net/route") as fh:  # Iface Destination Gateway ...: the stand-in is "lo 00000000"
        stand_in = any(line.split()[:2] == ["lo", "00000000"] for line in fh.read().splitlines()[1:])
    if stand_in:
        _ip(pid, "route", "del", "default", "dev", "lo")
        _ip(pid, "addr", "del", criu.STAND_IN_ADDR, "dev", "lo")


def restore(exe: str, images: Path, *, lowers: list[str], upper: Path, work: Path, merged: Path, run_dir: Path,
            tools: Path, boot_id: Path, procs_files: list[str], on_netns: Callable[[int], None] | None = None,
            userns: SharedUserns | None = None, volumes: Sequence[VolumeBind] = (), lazy: bool = False,
            served: list[threading.Thread] | None = None) -> int:
    """``criu restore`` into a fresh network namespace and the given cgroups; returns the restored
    init's host pid. The overlay is mounted on the host only while CRIU runs (the restored tree keeps
    its own copy in its mount namespace). ``on_netns``: called with a pid in the fresh network
    namespace while CRIU restores into it (nothing restored runs before CRIU ends), e.g. to write
    its filter meanwhile; an error there fails the restore. ``userns``: see ``restore_in_userns``
    (``on_netns`` must be None there: the network namespace is the image's, made by CRIU).
    ``volumes``: the E2B volumes bound where the dumped ones were (the same mount points); a
    read-only one's source is bound read-only first, so its restored bind is born read-only.
    What the namespace allowed only while CRIU restored sockets is undone before this returns
    (``end_restore_network``). ``lazy``: with CRIU lazy pages (``lazypages.py``; ``served``: its
    daemon's reaper thread, ``lazy_restore``'s)."""
    pidfile = run_dir / "criu-restore.pid"
    log = run_dir / RESTORE_LOG
    userns = _userns_for(images, userns)
    if (images / DEBUG_LOG).exists():  # keep_debug_log
        _copy_owned(images / DEBUG_LOG, run_dir / DEBUG_LOG)
    if userns is not None and lazy:
        # a task restored into a user namespace opens its userfaultfd there, which this kernel
        # refuses without vm.unprivileged_userfaultfd = 1 (CAP_SYS_PTRACE in the host's namespace)
        _log.warning("ns_fork_lazy_pages: not in a user namespace's restore; restoring every page first")
        lazy = False
    if userns is not None:
        if on_netns is not None:
            raise ValueError("a restore in a user namespace has no fresh network namespace to hand out")
        pid = restore_in_userns(exe, images, userns, lowers=lowers, upper=upper, work=work, merged=merged,
                                run_dir=run_dir, tools=tools, boot_id=boot_id, procs_files=procs_files,
                                volumes=volumes, lazy=lazy, served=served)
        end_restore_network(pid)
        return pid
    mount_overlay(criu.overlay_options(lowers, upper, work), merged)
    try:
        masked = criu.masked_here()
        read_only = [str(v.source) for v in volumes if v.read_only]
        with lazy_restore(exe, images, kdat_cache(exe), lazy, run_dir.parent.name, served) as lazy_work:
            run_criu(criu.in_cgroups_argv(procs_files, criu.in_fresh_netns_argv(criu.restore_argv(
                exe, images, root=merged, pidfile=pidfile, tools=tools, run_dir=run_dir, log=str(log),
                boot_id=boot_id, masked=masked, volumes=[(v.path, str(v.source)) for v in volumes],
                read_only_volumes=[v.path for v in volumes if v.read_only], lazy_work=lazy_work),
                kdat=kdat_cache(exe), read_only=criu.read_only_sources(tools, boot_id, masked, read_only),
                ready=on_netns is not None, stand_in_route=(images / criu.OUTSIDE_TCP_MARK).exists())),
                log, "restore", on_ready=on_netns, env=tmpfs_tar.criu_env(criu.KDAT_BASE))
    finally:
        _libc.umount2(os.fsencode(merged), _MNT_DETACH)  # the restored tree holds its own copy
    pid = int(pidfile.read_text().strip())
    end_restore_network(pid)
    return pid


def _userns_for(images: Path, server: SharedUserns | None) -> SharedUserns | None:
    """The user namespace to restore ``images`` into: the one they were dumped in (``dumped_userns``),
    which must be the server's; images of a tree in the host's namespace restore there, whatever
    the server's setting (a snapshot taken before ``ns_userns_uid`` was set keeps working)."""
    base = dumped_userns(images)
    if base is None:
        return None
    if server is None:
        raise CheckpointError("these processes were saved in a user namespace and this server runs ns sandboxes "
                              "without one (ns_userns_uid = 0, or unusable here: see `aenv doctor`)")
    if base and base != server.host_uid:
        raise CheckpointError(f"these processes were saved in a user namespace whose root is host uid {base}; "
                              f"this server's is {server.host_uid} (ns_userns_uid)")
    return server


def mount_overlay(options: str, target: Path) -> None:
    """mount(2) of an overlay at ``target`` (what ``mount -t overlay`` does, without its exec)."""
    if _libc.mount(b"overlay", os.fsencode(target), b"overlay", 0, options.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount overlay at {target}: {os.strerror(err)}")


STAGE_PREFIX = "aenv-restore-"  # restore_in_userns's stage dirs under criu.KDAT_BASE
STAGE_MAX_AGE = 600.0  # s: no restore takes that long; an older stage dir is a SIGKILL's leftover


def sweep_stages(base: Path = criu.KDAT_BASE, now: float | None = None) -> list[str]:
    """Remove the stage dirs of restores that a SIGKILL of their server cut short (between the
    ``mkdtemp`` and the ``finally``). Only empty ones (``rmdir``) older than :data:`STAGE_MAX_AGE`:
    a younger one may be a running restore of another server, whose tmpfs is mounted there in
    CRIU's namespace only (the host sees it empty). Returns their names."""
    now = time.time() if now is None else now
    gone: list[str] = []
    for d in base.glob(f"{STAGE_PREFIX}*"):
        with contextlib.suppress(OSError):  # not empty, not ours to remove, or gone meanwhile
            if now - d.stat().st_mtime > STAGE_MAX_AGE:
                d.rmdir()
                gone.append(d.name)
    return gone


def restore_in_userns(exe: str, images: Path, userns: SharedUserns, *, lowers: list[str], upper: Path,
                      work: Path, merged: Path, run_dir: Path, tools: Path, boot_id: Path,
                      procs_files: list[str], volumes: Sequence[VolumeBind] = (), lazy: bool = False,
                      served: list[threading.Thread] | None = None) -> int:
    """``restore`` of a user-namespaced sandbox's images (``dump`` marked them): CRIU makes the user
    namespace again from the dumped map and the network namespace inside it; a thread of the server
    in a private mount namespace mounts the overlay over idmapped layers and a fresh /dev
    (``launch.restore_mounts``) and spawns CRIU there, so nothing is mounted on the host. As on the plain path,
    the sources of the read-only host binds are bound read-only over themselves there first
    (``criu.read_only_sources``, the staged ones by their staged paths): every restored bind is born
    read-only, and the action script only checks so at pre-resume. The filter of an internet sandbox
    goes in after CRIU, before slirp4netns gives it a tap (``Restorer.filter_while_restoring`` in ``restored.py``).
    Each volume is staged as an idmapped clone made by host root (``launch.restore_mounts``), for CRIU,
    which cannot idmap from inside the user namespace, to bind as it is where the dumped one was."""
    pidfile = run_dir / "criu-restore.pid"
    log = run_dir / RESTORE_LOG
    os.chown(run_dir, userns.host_uid, userns.host_uid)  # restored sockets are bound there from inside
    fd = userns.fd()
    stage = Path(tempfile.mkdtemp(prefix=STAGE_PREFIX, dir=criu.KDAT_BASE))  # a tmpfs every uid can walk
    stage.chmod(0o755)
    masked = criu.masked_here()
    staged = {f"vol-{i}": v for i, v in enumerate(volumes)}
    argv = criu.restore_argv(exe, images, root=merged, pidfile=pidfile, tools=stage / "tools", run_dir=stage / "run",
                             log=str(log), boot_id=stage / "boot_id", masked=masked, net_external=False,
                             dev=stage / "dev", volumes=[(v.path, str(stage / n)) for n, v in staged.items()],
                             read_only_volumes=[v.path for v in volumes if v.read_only], empty_net=True)
    cfg = {"userns": {"fd": fd, "uid": userns.host_uid}, "lowers": lowers,
           "upper": str(upper), "work": str(work), "merged": str(merged),
           "stage_dir": str(stage), "stage": {"tools": str(tools), "run": str(run_dir), "boot_id": str(boot_id)},
           "stage_idmapped": {n: str(v.source) for n, v in staged.items()},
           "read_only": criu.read_only_sources(stage / "tools", stage / "boot_id", masked)}
    kdat = kdat_cache(exe)
    bind_kdat = _kdat_mount(kdat)

    def mounts() -> None:
        launch.restore_mounts(cfg)
        if bind_kdat is not None:
            bind_kdat()

    try:
        with lazy_restore(exe, images, kdat, lazy, run_dir.parent.name, served) as lazy_work:
            if lazy_work is not None:
                argv += ["--lazy-pages", "-W", str(lazy_work)]
            run_criu(criu.in_cgroups_argv(procs_files, argv), log, "restore", mounts=mounts,
                     env=tmpfs_tar.criu_env(criu.KDAT_BASE))
    finally:
        stage.rmdir()  # its mounts were in CRIU's namespace only
    return int(pidfile.read_text().strip())

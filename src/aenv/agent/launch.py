"""Stage 2 of starting a sandbox: runs as PID 1 of the fresh namespaces, builds the root, execs the agent.

Stage 1 is util-linux ``unshare --fork --pid --mount --uts --ipc --net --propagation private``: a tiny
C parent that stays behind only to reap us, so the server never has to. This file is imported as a
module by the host interpreter in isolated mode (``host_argv``: ``python -I -S -c BOOT DIR CONFIG``),
so it must import nothing but the stdlib, and little of it: every import is paid at every start.
Steps, in the order CRIU and isolation need them:

1. report our host PID and start time (read through the host's /proc before we mount our own);
2. join the sandbox cgroups, so every descendant is accounted and limited from the first instant;
3. overlay root (shared read-only lowers + per-sandbox upper), /proc (its boot id the sandbox's own,
   bind-mounted read-only from the host's file), a minimal /dev (bind-mounted host nodes, private
   devpts, /dev/shm), ``/.aenv`` (tools, read-only), ``/.aenv-run`` (channel);
4. hostname, loopback up;
5. ``pivot_root`` (not chroot) and detach the old root, so no host path is reachable;
6. drop dangerous capabilities from the bounding set; load the seccomp filter (``syscall_filter.py``)
   after the steps above, which need ``mount`` and ``pivot_root``, and before trimming our own
   capabilities, because without ``no_new_privs`` (opt-in: it would break ``sudo``) only a holder of
   CAP_SYS_ADMIN may load one; then ``setsid``, stdio from inside the sandbox;
7. exec the agent from ``/.aenv`` with an empty environment and no inherited fds.

Everything is mounted inside the private mount namespace: nothing appears on the host, so a crash
leaves no mount behind. Any failure is reported as one JSON line ``{"error": ...}`` on stdout.

With a user namespace (``cfg["userns"]``, ``run_in_userns``) the server runs this file directly and it
does stage 1's job itself, in another order: the root is built first, as host root over idmapped
layers (``idmap.py``), then the user namespace is joined and the other namespaces are created in it
(CRIU needs them owned by it), and the fork's parent stays behind to reap the init.
"""

from __future__ import annotations

import _json  # the C half of json: its string escaper, without json's import of re and enum (~7 ms)
import _socket  # socket without its enum wrappers (~3 ms)
import ctypes
import fcntl
import marshal
import os
import struct
import sys
import types

try:  # the zygote imports us as a module ...
    from aenv.agent import idmap, syscall_filter
except ImportError:  # ... the plain path runs us as a script in isolated mode: load them from beside us
    import importlib.util

    def _beside(name: str):  # type: ignore[no-untyped-def]
        spec = importlib.util.spec_from_file_location(
            f"aenv_{name}", os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    syscall_filter = _beside("syscall_filter")
    idmap = _beside("idmap")

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 0x2
SYS_PIVOT_ROOT = 155  # x86_64
PR_CAPBSET_DROP = 24
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1

# Capabilities kept in the sandbox (Docker's default set). Everything else (SYS_ADMIN, MKNOD,
# DAC_READ_SEARCH, NET_ADMIN, SYS_PTRACE, SYS_MODULE, ...) is dropped from the bounding set, so
# sandbox root cannot mount, create device nodes, open files by handle or change its firewall.
KEEP_CAPS = frozenset({0, 1, 3, 4, 5, 6, 7, 8, 10, 13, 18, 29, 31})
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")
# /proc entries that are global to the host: read-only or hidden, as container runtimes do.
PROC_READONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs")
PROC_MASKED = ("kcore", "keys", "timer_list", "sched_debug", "kallsyms")
BOOT_ID = "sys/kernel/random/boot_id"  # under /proc: each sandbox start has one of its own

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(src: str, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    _check(
        _libc.mount(src.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                    data.encode() if data else None),
        f"mount {fstype or 'bind'} {src} -> {target}",
    )


def detach(target: str) -> None:
    """Lazily unmount ``target`` (``MNT_DETACH``); nothing to do when it is not a mount point (any more)."""
    _libc.umount2(target.encode(), MNT_DETACH)


def bind(src: str, target: str, *, readonly: bool = False, extra: int = 0) -> None:
    mount(src, target, None, MS_BIND | MS_REC)
    flags = MS_BIND | MS_REMOUNT | extra | (MS_RDONLY if readonly else 0)
    if flags != MS_BIND | MS_REMOUNT:
        mount("none", target, None, flags)


def overlay_options(lowers: list[str], upper: str, work: str) -> str:
    """Mount data for overlayfs. ``:`` and ``,`` in paths would break it; the runtime never makes such paths."""
    for p in (*lowers, upper, work):
        if ":" in p or "," in p:
            raise ValueError(f"overlay path may not contain ':' or ',': {p!r}")
    return f"lowerdir={':'.join(lowers)},upperdir={upper},workdir={work}"


def host_identity() -> tuple[int, int]:
    """Our PID and start time as the host sees them (host /proc is still mounted at this point)."""
    pid = int(os.readlink("/proc/self"))
    with open(f"/proc/{pid}/stat") as fh:
        stat = fh.read()
    start = int(stat.rsplit(")", 1)[1].split()[19])
    return pid, start


def join_cgroups(procs_files: list[str]) -> None:
    """Write "0" (= the writer itself): cgroupfs resolves pids in the *writer's* pid namespace, where
    our host pid means nothing."""
    for path in procs_files:
        with open(path, "w") as fh:
            fh.write("0")


def _mkdir(path: str, mode: int = 0o755) -> None:
    os.makedirs(path, mode=mode, exist_ok=True)


def _touch(path: str) -> None:
    if not os.path.lexists(path):
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))


def harden_proc(proc: str) -> None:
    """Sandbox root keeps CAP_DAC_OVERRIDE, so host-global knobs (/proc/sys, sysrq-trigger) must be
    read-only mounts; without CAP_SYS_ADMIN it cannot remount them."""
    for name in PROC_READONLY:
        path = f"{proc}/{name}"
        if os.path.exists(path):
            bind(path, path, readonly=True, extra=MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for name in PROC_MASKED:
        path = f"{proc}/{name}"
        if os.path.exists(path):
            bind("/dev/null", path, readonly=True)  # read-only: it is the host's /dev/null inode


def dev_skeleton(dev: str) -> None:
    """A tmpfs at ``dev`` with the files, directories and links of the sandbox's /dev (no mounts)."""
    _mkdir(dev)
    mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=65536k")
    for name in DEV_NODES:
        _touch(f"{dev}/{name}")
    _mkdir(f"{dev}/pts")
    os.symlink("pts/ptmx", f"{dev}/ptmx")
    _mkdir(f"{dev}/shm", 0o1777)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{dev}/{name}")


def setup_dev(root: str) -> None:
    dev = f"{root}/dev"
    dev_skeleton(dev)
    for name in DEV_NODES:
        # Read-only bind: the node is the host's own inode, and sandbox root owns it (no user
        # namespace), so a writable bind would let it chmod/chown/utime the host's /dev/null.
        # I/O on a device node is not affected by a read-only mount.
        bind(f"/dev/{name}", f"{dev}/{name}", readonly=True)
    mount("devpts", f"{dev}/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620")
    mount("shm", f"{dev}/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=65536k")


def mount_proc(root: str, boot_id: str | None, *, nested: bool = False) -> None:
    """/proc of the sandbox's PID namespace (mounted by a process in it), hardened, its own boot id.
    ``nested`` (Docker inside, user namespace only): /proc/sys/net stays writable, as dockerd sets its
    network's sysctls (the kernel checks those against the sandbox's own network namespace)."""
    _mkdir(f"{root}/proc")
    mount("proc", f"{root}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if nested:  # bound before /proc/sys is made read-only: its recursive bind keeps this one writable
        bind(f"{root}/proc/sys/net", f"{root}/proc/sys/net", extra=MS_NOSUID | MS_NODEV | MS_NOEXEC)
    harden_proc(f"{root}/proc")
    if boot_id:
        bind(boot_id, f"{root}/proc/{BOOT_ID}", readonly=True, extra=MS_NOSUID | MS_NODEV | MS_NOEXEC)


def populate_root(root: str, cfg: dict) -> None:  # type: ignore[type-arg]
    """Everything of the root but the overlay and /proc: /dev, /tmp, the tools and channel binds, resolv.conf."""
    setup_dev(root)
    _mkdir(f"{root}/tmp", 0o1777)
    _mkdir(f"{root}/.aenv")
    bind(cfg["tools"], f"{root}/.aenv", readonly=True, extra=MS_NOSUID | MS_NODEV)
    _mkdir(f"{root}/.aenv-run", 0o700)
    bind(cfg["run"], f"{root}/.aenv-run", extra=MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if cfg.get("resolv_conf"):
        _mkdir(f"{root}/etc")
        path = f"{root}/etc/resolv.conf"
        if os.path.islink(path):
            os.unlink(path)
        with open(path, "w") as fh:
            fh.write(cfg["resolv_conf"])
    bind_volumes(root, cfg)


def volume_point(root: str, path: str) -> str:
    """The directory ``path`` inside ``root`` (still the host's view: nothing is pivoted yet), made
    where missing. A component that is a symlink is refused, never followed: the image's files could
    point it anywhere on the host."""
    cur = root
    for part in [p for p in path.split("/") if p]:
        if part in (".", ".."):
            raise ValueError(f"volume mount path {path!r} is not normalised")
        cur = f"{cur}/{part}"
        if os.path.islink(cur):
            raise ValueError(f"volume mount path {path} crosses a symlink in the image ({cur[len(root):]})")
        if not os.path.lexists(cur):
            os.mkdir(cur, 0o755)
        elif not os.path.isdir(cur):
            raise ValueError(f"volume mount path {path}: {cur[len(root):]} is not a directory in the image")
    return cur


def bind_volumes(root: str, cfg: dict) -> None:  # type: ignore[type-arg]
    """E2B volumes (``cfg["volumes"]``: [host dir, path, read-only]) bound into the root. In a user
    namespace the bind is idmapped like the root's layers (a volume's files keep the uids the sandbox
    sees); a read-only one is locked so in the sandbox's namespaces (no CAP_SYS_ADMIN there, and in a
    user namespace the flag is locked by the kernel)."""
    userns = cfg.get("userns")
    for src, path, read_only in cfg.get("volumes") or ():
        target = volume_point(root, path)
        if userns:
            idmap.idmapped_bind(src, target, int(userns["fd"]))
            flags = MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV | (MS_RDONLY if read_only else 0)
            mount("none", target, None, flags)
        else:
            bind(src, target, readonly=bool(read_only), extra=MS_NOSUID | MS_NODEV)


def build_root(cfg: dict) -> str:  # type: ignore[type-arg]
    root = str(cfg["merged"])
    mount("none", "/", None, MS_REC | MS_PRIVATE)
    _mkdir(root)
    mount("overlay", root, "overlay", 0, overlay_options(cfg["lowers"], cfg["upper"], cfg["work"]))
    mount_proc(root, cfg.get("boot_id"))
    populate_root(root, cfg)
    return root


def loopback_up() -> None:
    s = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
    try:
        ifreq = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, ifreq))[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | IFF_UP, b""))
    finally:
        s.close()


def pivot(root: str) -> None:
    os.chdir(root)
    # pivot_root(".", ".") stacks the old root on top of the new one; detaching it leaves only ours.
    _check(_libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")


def drop_capabilities() -> None:
    with open("/proc/sys/kernel/cap_last_cap") as fh:
        last = int(fh.read())
    for cap in range(last + 1):
        if cap not in KEEP_CAPS:
            _check(_libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap}")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


_LINUX_CAPABILITY_VERSION_3 = 0x20080522


def limit_current_capabilities() -> None:
    """Trim this process's own effective/permitted/inheritable sets to KEEP_CAPS.

    Dropping from the bounding set only bites at the next exec. The zygote path never execs the agent
    or envd, so without this they would keep CAP_SYS_ADMIN and friends inside the sandbox."""
    mask = 0
    for cap in KEEP_CAPS:
        mask |= 1 << cap
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    for i in range(2):
        word = (mask >> (32 * i)) & 0xFFFFFFFF
        data[i].effective = data[i].permitted = word
        data[i].inheritable = 0
    _check(_libc.capset(ctypes.byref(header), data), "capset")


def report(obj: dict[str, int | str]) -> None:
    """One JSON line to the server: a flat object of ints and strings (all the launcher reports)."""
    def value(v: int | str) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        return str(v) if isinstance(v, int) else str(_json.encode_basestring_ascii(v))

    fields = (f"{_json.encode_basestring_ascii(k)}: {value(v)}" for k, v in obj.items())
    os.write(1, ("{" + ", ".join(fields) + "}\n").encode())


def enter(cfg: dict) -> None:  # type: ignore[type-arg]
    """Everything but the final exec: after this returns we are PID 1 inside the finished sandbox,
    with stdio pointing inside it. The zygote calls this and then runs the agent in-process."""
    pid, start = host_identity()
    join_cgroups(cfg["cgroup_procs"])
    root = build_root(cfg)
    hostname = cfg.get("hostname", "aenv").encode()
    _check(_libc.sethostname(hostname, len(hostname)), "sethostname")
    loopback_up()
    pivot(root)
    _contain_and_report(cfg, pid, start)


def _contain_and_report(cfg: dict, pid: int, start: int) -> None:  # type: ignore[type-arg]
    """Step 6 and the report: after pivot_root, in the sandbox's final namespaces. A ``nested`` sandbox
    (Docker inside; only ever in a user namespace) keeps every capability *of its user namespace* and
    gets the filter's nested variant, which lets it mount and make namespaces, as dockerd and runc must."""
    nested = bool(cfg.get("nested"))
    if not nested:
        drop_capabilities()
    if cfg.get("seccomp", True):
        syscall_filter.install(no_new_privs=bool(cfg.get("no_new_privs", False)), nested=nested)
    if not nested:
        limit_current_capabilities()
    os.setsid()
    report({"pid": pid, "start": start})
    # stdio from inside the sandbox only: CRIU refuses fds that point at host files.
    null = os.open("/dev/null", os.O_RDWR)
    log = os.open(cfg["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600) if cfg.get("log") else null
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)


def _build_idmapped_root(cfg: dict, userns_fd: int, host_uid: int, *,  # type: ignore[type-arg]
                         populate: bool = True) -> str:
    """Steps 3 without /proc, as host root in a private mount namespace: each lower and the upper's
    directory bound idmapped under a tmpfs of the sandbox directory (``idmap.py``), the overlay over
    them and (``populate``) the rest of the root made as the sandbox's root."""
    root, upper, work = str(cfg["merged"]), str(cfg["upper"]), str(cfg["work"])
    if os.path.dirname(upper) != os.path.dirname(work):
        raise ValueError("upper and work must share a directory (overlayfs wants them on one mount)")
    mount("none", "/", None, MS_REC | MS_PRIVATE)
    layers = os.path.join(os.path.dirname(upper), "idmapped")
    _mkdir(layers, 0o700)
    mount("tmpfs", layers, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=700")
    lowers = []
    for i, lower in enumerate(cfg["lowers"]):
        idmap.idmapped_bind(lower, f"{layers}/{i}", userns_fd)
        lowers.append(f"{layers}/{i}")
    idmap.idmapped_bind(os.path.dirname(upper), f"{layers}/rw", userns_fd)
    _mkdir(root)
    with idmap.as_sandbox_root(host_uid):
        rw = f"{layers}/rw"
        mount("overlay", root, "overlay", 0, overlay_options(
            lowers, f"{rw}/{os.path.basename(upper)}", f"{rw}/{os.path.basename(work)}"))
        if populate:
            _mkdir(f"{root}/proc")
            populate_root(root, cfg)
            if cfg.get("nested"):
                bind_nested_data(root, rw)
    return root


NESTED_DATA = "/var/lib/docker"


def bind_nested_data(root: str, rw: str) -> None:
    """Docker's data directory on the sandbox directory's own filesystem, beside the root's upper: on
    the root overlay, dockerd's overlay2 could not stack (overlayfs is no upper layer) and would fall
    back to copying every image layer whole."""
    data = f"{rw}/nested-data"
    _mkdir(data, 0o711)
    mount(data, volume_point(root, NESTED_DATA), None, MS_BIND)


def restore_mounts(cfg: dict) -> None:  # type: ignore[type-arg]
    """What a CRIU restore of a user-namespaced sandbox needs (``checkpoint.restore_in_userns``), made
    by host root in a private mount namespace the caller entered (a thread of the server's of its
    own: ``nsthread.in_private_mounts``, CRIU then spawned from it): the root overlay as
    ``_build_idmapped_root`` mounts it, and the external mounts' sources staged in ``cfg["stage_dir"]``
    (an empty directory any uid can walk to: CRIU opens them from inside the new user namespace, where
    the 0700 state directory cannot be walked), on a tmpfs: ``cfg["stage"]`` (name -> host path) bound
    there, each of ``cfg["stage_idmapped"]`` (the volumes: name -> host path) bound idmapped and
    writable (CRIU restores a bind with its dumped flags and cannot clear a read-only flag locked
    in the user namespace; the action script makes a read-only one so before any task runs), a
    fresh /dev as ``dev``;
    then each of ``cfg["read_only"]`` (path, MS_* flags) bound
    read-only over itself (what ``criu.in_fresh_netns_argv`` does on the plain path)."""
    _build_idmapped_root(cfg, int(cfg["userns"]["fd"]), int(cfg["userns"]["uid"]), populate=False)
    stage = str(cfg["stage_dir"])
    mount("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755")
    for name, src in cfg["stage"].items():
        target = f"{stage}/{name}"
        _mkdir(target) if os.path.isdir(src) else _touch(target)
        bind(src, target)
    for name, src in cfg.get("stage_idmapped", {}).items():  # volumes: CRIU cannot idmap them
        idmap.idmapped_bind(src, f"{stage}/{name}", int(cfg["userns"]["fd"]))
    dev_skeleton(f"{stage}/dev")
    for src, flags in cfg.get("read_only", ()):  # criu.read_only_sources: every restored host bind born read-only
        bind(src, src, readonly=True, extra=int(flags))


def _reap_forever(child: int, tools: str | None = None) -> None:
    """Stage 1's last job (what ``unshare --fork`` does on the plain path): wait for the sandbox's
    init and exit with its status, holding no capability and no fd of the host. Done by the bundle's
    static ``reap`` (exec keeps the child ours) where there is one: an interpreter left waiting holds
    ~6 MB of its own per sandbox, outside the sandbox's cgroup. ``no_new_privs`` keeps the exec from
    raising the emptied capability sets again (uid 0 of the user namespace would regain them)."""
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    if null > 2:
        os.close(null)
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    _check(_libc.capset(ctypes.byref(header), (_CapData * 2)()), "capset")
    if tools is not None:
        _check(_libc.prctl(syscall_filter.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        reap = f"{tools}/bin/reap"
        try:
            os.execv(reap, [reap, str(child)])
        except OSError:
            pass  # an older bundle, or built without a C compiler: wait here
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == child:
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = (
    0x00020000, 0x04000000, 0x08000000, 0x20000000, 0x40000000)


def _nested() -> types.ModuleType:
    """``nested.py`` (its router and its /sys), imported only by a sandbox that runs Docker inside."""
    try:
        from aenv.agent import nested
    except ImportError:  # run as ``python -I -S``: this directory is on the path (``BOOT``)
        import nested  # type: ignore[no-redef,import-not-found]
    return nested


def run_in_userns(cfg: dict) -> None:  # type: ignore[type-arg]
    """The whole start with a user namespace (``cfg["userns"]``: an inherited fd of it and the host
    uid its root maps to). The server runs us directly, not under ``unshare``: the mounts need host
    root, and CRIU can only dump a tree whose user namespace owns its other namespaces, so we build
    the root first, join the user namespace, then create the others in it and fork the sandbox's
    init, staying behind to reap it. Host paths are reached before joining (the sandbox directory is
    0700 host root): the root by the working directory, the cgroups and boot id by open fds."""
    userns_fd, host_uid = int(cfg["userns"]["fd"]), int(cfg["userns"]["uid"])
    if _libc.unshare(CLONE_NEWNS) != 0:
        _check(-1, "unshare mount namespace")
    procs = [os.open(path, os.O_WRONLY | os.O_CLOEXEC) for path in cfg["cgroup_procs"]]
    # a detached copy of the boot id's mount: a bind from a path or fd of this mount namespace would
    # be refused in the sandbox's (EINVAL), attaching a detached tree is not
    boot_id = idmap.clone_tree(cfg["boot_id"]) if cfg.get("boot_id") else None
    os.chdir(_build_idmapped_root(cfg, userns_fd, host_uid))
    idmap.join(userns_fd)
    os.close(userns_fd)
    nested = _nested() if cfg.get("nested") else None
    if nested is not None:  # returns in the sandbox's own user namespace, behind the router
        nested.behind_router(cfg, [*procs, *([boot_id] if boot_id is not None else [])])
    net = 0 if cfg.get("nested") else CLONE_NEWNET  # nested: made behind the router already
    if _libc.unshare(CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWPID | net) != 0:
        _check(-1, "unshare namespaces")
    hostname = cfg.get("hostname", "aenv").encode()
    _check(_libc.sethostname(hostname, len(hostname)), "sethostname")
    loopback_up()
    child = os.fork()
    if child:
        for fd in [*procs, *([boot_id] if boot_id is not None else [])]:
            os.close(fd)
        _reap_forever(child, cfg.get("tools"))
    for fd in procs:  # "0" = ourselves, as in join_cgroups; the fds carry the host's permission
        os.write(fd, b"0")
        os.close(fd)
    pid, start = host_identity()  # the host's /proc is still mounted beside ours
    mount_proc(".", None, nested=bool(cfg.get("nested")))
    if nested is not None:
        nested.mount_sys()
    if boot_id is not None:
        idmap.attach(boot_id, f"proc/{BOOT_ID}")
        mount("none", f"proc/{BOOT_ID}", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    idmap.rebind_root()
    pivot(".")
    _contain_and_report(cfg, pid, start)
    argv = cfg["argv"]
    os.execve(argv[0], argv, cfg.get("env", {}))


def run(cfg: dict) -> None:  # type: ignore[type-arg]
    if cfg.get("userns"):
        run_in_userns(cfg)
    enter(cfg)
    argv = cfg["argv"]
    os.execve(argv[0], argv, cfg.get("env", {}))


# Run as ``python -I -S -c BOOT <this directory> <cfg>`` (``host_argv``) rather than as a script: a script
# is compiled from source at every start (~10 ms of CPU per launch and per restore), an import uses
# the cached bytecode. The config travels as hex of ``marshal``: the same interpreter writes and
# reads it, and unlike json it needs no import.
BOOT = "import sys; sys.path.insert(0, sys.argv.pop(1)); import launch; launch.main()"


def host_argv(cfg: dict) -> list[str]:  # type: ignore[type-arg]
    """The host-side command that runs this launcher with ``cfg`` under this interpreter (isolated mode)."""
    return [sys.executable, "-I", "-S", "-c", BOOT, os.path.dirname(os.path.abspath(__file__)), marshal.dumps(cfg).hex()]


def config_of(argv: list[str]) -> dict:  # type: ignore[type-arg]
    """The config a ``host_argv`` command line carries (its last word)."""
    cfg: dict = marshal.loads(bytes.fromhex(argv[-1]))  # type: ignore[type-arg]
    return cfg


def main() -> None:
    cfg = config_of(sys.argv)
    try:
        run(cfg)
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the host
        report({"error": f"{type(exc).__name__}: {exc}"})
        os._exit(1)


if __name__ == "__main__":
    main()

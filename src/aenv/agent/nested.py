"""The launcher's steps for a sandbox that runs Docker inside: its router (``behind_router``), its /sys.

Kept apart from ``launch.py`` so that only such a sandbox pays for them: the launcher imports this
module (``launch._nested``) for it alone. Stdlib only, beside the launcher it uses (``launch.py``
loads it from beside itself under ``python -I -S``). Such a sandbox holds every capability of a user
namespace of its own, so the firewall of its network namespace is its to rewrite. The launcher's first
process therefore stays behind as a router, in a network namespace the sandbox cannot touch (where
slirp4netns attaches and the host's egress filter is installed), linked to the sandbox's own network
namespace by a veth pair. The two processes take their steps in lockstep over a pair of pipes: the
sandbox side makes each namespace, the router side maps or links it.
"""

from __future__ import annotations

import ctypes
import os

try:  # imported by the launcher, loaded by then: as part of aenv (the zygote, tests) ...
    from aenv.agent import launch
except ImportError:  # ... or as the top-level module ``launch`` under ``python -I -S``
    import launch  # type: ignore[no-redef,import-not-found]

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
CLONE_NEWNS, CLONE_NEWCGROUP = 0x00020000, 0x02000000  # the router's mounts; /sys's cgroup namespace
PR_SET_DUMPABLE = 4
# The link between a nested sandbox and its router: the router's end, the sandbox's end, the prefix.
ROUTER_ADDR, NESTED_ADDR, NESTED_PREFIX = "10.0.3.1", "10.0.3.2", 30
NESTED_IDS = "0 0 65536\n"  # the nested user namespace's ids are the sandbox's own
ROUTER_LINK = "aenv-nested"

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def ip(*args: str) -> None:
    """Run the host's iproute2 ``ip`` (fork and exec: the host Python's stdlib cannot be imported any more
    once we are in the sandbox's user namespace, its directory being host root's)."""
    exe = next((p for p in ("/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip") if os.path.exists(p)), None)
    if exe is None:
        raise OSError("iproute2's ip is not installed on the host (apt-get install iproute2)")
    pid = os.fork()
    if pid == 0:
        try:
            os.execve(exe, ["ip", *args], {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
        finally:
            os._exit(127)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        raise OSError(f"ip {' '.join(args)} failed (status {os.waitstatus_to_exitcode(status)})")


def sandbox_side(up_w: int, down_r: int) -> None:
    """In the forked child: a user namespace (mapped by the router), then a network namespace (linked by
    the router), then the sandbox's end of the link addressed and routed through the router."""
    _check(_libc.unshare(CLONE_NEWUSER), "unshare the nested user namespace")
    # joining the sandbox's user namespace left us undumpable: our /proc files root's, whose uid
    # the router does not have; dumpable, they are our own uid's, and the router may write the maps
    _check(_libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    os.write(up_w, b"u")
    if os.read(down_r, 1) != b"m":
        raise OSError("the router did not map the nested user namespace")
    _check(_libc.unshare(CLONE_NEWNET), "unshare the nested network namespace")
    os.write(up_w, b"n")
    if os.read(down_r, 1) != b"v":
        raise OSError("the router did not link the nested network namespace")
    os.close(up_w)
    os.close(down_r)
    ip("addr", "add", f"{NESTED_ADDR}/{NESTED_PREFIX}", "dev", "eth0")
    ip("link", "set", "eth0", "up")
    ip("route", "add", "default", "via", ROUTER_ADDR)


def router_side(child: int, up_r: int, down_w: int) -> None:
    """In the router: map the child's user namespace to the sandbox's ids, then give its network
    namespace the other end of a veth pair and forward what comes over it."""
    if os.read(up_r, 1) != b"u":
        raise OSError("the nested sandbox ended before its user namespace was made")
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/{child}/{name}", "w") as fh:
            fh.write(NESTED_IDS)
    os.write(down_w, b"m")
    if os.read(up_r, 1) != b"n":
        raise OSError("the nested sandbox ended before its network namespace was made")
    ip("link", "add", ROUTER_LINK, "type", "veth", "peer", "name", "eth0", "netns", str(child))
    ip("addr", "add", f"{ROUTER_ADDR}/{NESTED_PREFIX}", "dev", ROUTER_LINK)
    ip("link", "set", ROUTER_LINK, "up")
    with open("/proc/sys/net/ipv4/ip_forward", "w") as fh:  # the host's /proc: our (router's) netns
        fh.write("1")
    os.write(down_w, b"v")


def behind_router(cfg: dict, fds: list[int]) -> None:  # type: ignore[type-arg]
    """A sandbox that runs Docker inside holds every capability of a user namespace of its own, so its
    network namespace's firewall is its to change. This process (the sandbox's root user namespace)
    becomes a router instead: a network namespace of its own, where slirp4netns attaches and the
    host's egress filter is installed (``net_pid``: this process), and which the sandbox cannot touch:
    its user namespace, made by the child, is a child of ours. Forks: the child returns, in the new user
    and network namespaces, for ``launch.run_in_userns`` to make the sandbox's other namespaces in
    them; this process stays behind as the router and reaps it."""
    if _libc.unshare(CLONE_NEWNS | CLONE_NEWNET) != 0:
        _check(-1, "unshare the router's namespaces")
    launch.loopback_up()
    up_r, up_w = os.pipe()
    down_r, down_w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(up_r)
        os.close(down_w)
        sandbox_side(up_w, down_r)
        return
    os.close(up_w)
    os.close(down_r)
    try:
        router_side(child, up_r, down_w)
    except BaseException as exc:
        launch.report({"error": f"{type(exc).__name__}: {exc}"})
        os.kill(child, 9)
        os._exit(1)
    for fd in (up_r, down_w, *fds):
        os.close(fd)
    launch._reap_forever(child, cfg.get("tools"))


def mount_sys() -> None:
    """/sys for Docker inside (the root is the working directory; the host's /proc still mounted): the
    sandbox network's own sysfs (runc mounts one in each container it starts, which the kernel allows
    only where a sysfs is already fully visible in the mount namespace), and under it the cgroup
    hierarchies in a cgroup namespace rooted at the sandbox's cgroups (runc wants them mounted even
    when, as here, it makes no cgroup of its own: the sandbox's limits bound every container)."""
    flags = launch.MS_NOSUID | launch.MS_NODEV | launch.MS_NOEXEC
    launch._mkdir("sys")
    launch.mount("sysfs", "sys", "sysfs", flags)
    if _libc.unshare(CLONE_NEWCGROUP) != 0:
        _check(-1, "unshare cgroup namespace")
    launch.mount("tmpfs", "sys/fs/cgroup", "tmpfs", flags, "mode=755")
    with open("/proc/self/cgroup") as fh:
        hierarchies = [line.split(":")[1] for line in fh.read().splitlines() if line.count(":") >= 2]
    for controllers in filter(None, hierarchies):  # "" is the unified (v2) hierarchy's line
        target = f"sys/fs/cgroup/{controllers.replace('name=', '')}"
        launch._mkdir(target)
        options = f"none,{controllers}" if controllers.startswith("name=") else controllers
        try:
            launch.mount("cgroup", target, "cgroup", flags, options)
        except OSError:  # a hierarchy this namespace may not mount: the others are enough for runc
            os.rmdir(target)

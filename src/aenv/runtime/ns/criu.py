"""CRIU for the ns runtime: run-time detection and pure command-line builders.

Process snapshots (``mode=full``) need CRIU >= 4.2 on this kernel family: Debian bookworm's 3.17 fails
``criu check`` (vDSO layout of kernels >= 6.13) and 4.1 cannot dump INET sockets on kernels >= 6.16
(see ``shared/notes/storage-and-runtime.md`` §4). So the capability is *detected*, never assumed:
``criu --version`` must say >= 4.2 **and** ``criu check`` must pass. ``probe()`` caches its answer
per executable path for the life of the process. Which executable: ``AENV_CRIU``, else the
``ns_criu`` setting, else the one the set-up builds (``<cache_dir>/criu/current/criu``,
``scripts/build-criu.sh``), else ``criu`` on PATH.

The builders only make argv lists (unit-tested without a CRIU binary); ``snapshot.py`` runs them.
What the sandbox design gives CRIU (``launcher.py``): ``pivot_root`` (not chroot), ``setsid`` inside the
pid namespace, stdio opened inside the sandbox, no inherited host fds. What is external to the dumped
tree and must be named on both sides: the read-only tools bind (``/.aenv``), the channel bind
(``/.aenv-run``), the boot id file, the bind-mounted host device nodes in ``/dev`` and the ``/dev/null``
masks over host-global ``/proc`` files. The **network namespace** is never dumped: a dump runs CRIU in
the tree's own one (``in_netns_of_argv``), so it is not a namespace of the tree to CRIU, and every
restore runs CRIU in a fresh one set up like a new sandbox's (loopback; internet: filter +
slirp4netns), where the tree is then restored. That is faster than dumping it and is the only way
with slirp4netns (its tap is held outside the tree). Listening and loopback sockets are restored into
it. Images dumped before named it external (``net[inode]:aenv-net``): the restore joins the fresh
one through ``--inherit-fd`` for those.

Two conditions the sandbox must meet, found here (dump.log): every mapped file must come from a mount
of the sandbox's own mount namespace, so sandboxes that may be dumped are started by exec inside the
sandbox, not forked from the zygote (whose preloaded modules are mapped from the host's mount:
"Can't lookup mount=… for fd=-3"); and no process may hold a socket of the host's network namespace
(the server's connections to the agent and envd: the accepted end of a unix connection lives in the
*connecting* side's netns, "Unix socket … not found"), so the host closes them before a dump
(``NsSandbox.quiesce``). envd runs with ``UV_USE_IO_URING=0``: CRIU cannot dump io_uring.

Two costs paid on every CRIU run that are not the sandbox's, both removed here (measured under load:
~60 ms of each dump and restore): CRIU probes the kernel (``kerndat``) and keeps the answer only in
``/run/criu.kdat`` *when /run is a tmpfs*, which it is not in many containers (this one: ext4), so it
probed again every time; ``in_kdat_cache_argv`` runs CRIU in a private mount namespace whose ``/run``
is a directory of ``/dev/shm`` (a tmpfs, emptied at reboot like /run), keyed by the executable. And its
network lock runs ``iptables-restore`` twice per run: the namespace is external (restores get a fresh
one with no peers; a dump's source keeps its own, and connections to outside slirp4netns cannot be
restored into a new namespace anyway), so ``--network-lock skip``.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from aenv.agent.launch import DEV_NODES, MS_NODEV, MS_NOEXEC, MS_NOSUID, PROC_MASKED
from aenv.runtime.network import SLIRP_TAP_ADDR
from aenv.runtime.ns.criu_action import compiled_action, conf_text

if TYPE_CHECKING:
    from aenv.config import Settings

MIN_VERSION = (4, 2)
ENV_EXE = "AENV_CRIU"  # override the executable (e.g. a 4.2.1 built from source in /opt)

# Mount points inside the sandbox that are bind mounts of host paths, keyed for --external.
EXT_TOOLS = "aenv-tools"
EXT_RUN = "aenv-run"
EXT_NET = "aenv-net"  # the sandbox's network namespace: never dumped, a fresh one at each restore
NET_FD = 3  # where the restore wrapper opens that fresh namespace for --inherit-fd
CACHE_SUBPATH = ("criu", "current", "criu")  # under the cache dir: what scripts/build-criu.sh leaves
EXT_DEV = "aenv-dev"  # a user-namespaced sandbox's /dev tmpfs: external, a fresh one at each restore
EXT_BOOT_ID = "aenv-boot-id"  # the sandbox's own boot id file (agent/launch.py); a restore gets a new one
BOOT_ID_MOUNT = "/proc/sys/kernel/random/boot_id"
KDAT_BASE = Path("/dev/shm")  # a tmpfs on any Linux host: CRIU keeps its kernel probe only on one
EXT_VOLUME = "aenv-vol-"  # + a digest of its mount point: an E2B volume's bind (agent/launch.py)
READY = "aenv-netns-ready"  # what the restore wrapper prints once its namespaces are made
PRE_RESUME = "pre-resume"  # the CRIU stage at which the restored tree exists and none of it runs yet
# A socket dumped bound to the tap's address (a connect under way, or one just refused and not yet
# closed) is bound to it again on restore, before the restored tree has a tap: its network namespace
# allows binding to addresses it lacks while CRIU restores (``in_fresh_netns_argv``, ``LO_UP``), and
# no longer once CRIU has ended (``checkpoint.end_restore_network``). Without it such a restore
# failed now and then with "Can't bind inet socket back: Cannot assign requested address".
NONLOCAL_BIND = "/proc/sys/net/ipv4/ip_nonlocal_bind"
# A TCP socket dumped connecting or connected to a peer outside the tree's loopback is connected again
# on restore (in repair mode: nothing is sent, but the kernel needs a route to the peer), again before
# the tree has a tap. A dump that holds one says so (``OUTSIDE_TCP_MARK``, ``checkpoint.dump``), and
# its restore gets the tap's address on loopback (the kernel routes from a local source only) and a
# stand-in default route through loopback until CRIU has ended. Without them such a restore
# failed with "Can't connect inet socket back: Network is unreachable". The connection itself is dead
# in the restored tree, as in a restored VM: its peer knows only the parent.
OUTSIDE_TCP_MARK = "aenv-outside-tcp"
# A TCP connection not yet accepted (in a listener's queue) when the tree is frozen: CRIU cannot dump
# one and refused the whole dump ("In-flight connection (l)"), which a server of the sandbox that is
# being connected to (envd's TCP port by the agent's relay, anything the sandbox serves) made
# happen now and then. Skipped, the listener is dumped without it: in the restored tree the
# connecting end is reset, as a peer that went away would be; the source runs on untouched.
SKIP_IN_FLIGHT = "--skip-in-flight"
STAND_IN_ADDR = f"{SLIRP_TAP_ADDR}/32"  # the tap's, the only source such a socket has
STAND_IN_ROUTE = f"ip addr add {STAND_IN_ADDR} dev lo && ip route add default dev lo"

Runner = Callable[..., "subprocess.CompletedProcess[str]"]


@dataclass(frozen=True)
class CriuStatus:
    """What ``criu`` on this host can do for us. ``usable`` is the only thing callers branch on."""

    exe: str | None
    version: tuple[int, int, int] | None
    usable: bool
    reason: str

    def describe(self) -> str:
        """One line for capabilities() / doctor: "4.2.1 at /usr/sbin/criu" or "absent: ..."."""
        if self.usable:
            v = ".".join(map(str, self.version or ()))
            return f"{v} at {self.exe}"
        return self.reason


def parse_version(text: str) -> tuple[int, int, int] | None:
    """``criu --version`` prints "Version: 3.17.1" (sometimes followed by "GitID: ...")."""
    m = re.search(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def candidates(settings: Settings | None = None) -> list[str]:
    """Where to look, first match wins: AENV_CRIU, the ns_criu setting, the set-up's build, PATH."""
    from aenv.config import default_cache_dir

    env = os.environ.get(ENV_EXE)
    if env:
        return [env]  # an explicit choice: nothing else is tried behind its back
    if settings is not None and settings.ns_criu is not None:
        return [str(settings.ns_criu)]
    cache = settings.cache_dir if settings is not None else default_cache_dir()
    out = [str(cache.joinpath(*CACHE_SUBPATH))]
    which = shutil.which("criu")
    return out + ([which] if which else []) + ["/usr/sbin/criu", "/usr/local/sbin/criu"]


FOUND_TTL_S = 10.0  # how long a lookup of the executable stands (one CRIU installed later is found soon)
_found: dict[tuple[object, ...], tuple[float, str | None]] = {}


def find_exe(settings: Settings | None = None) -> str | None:
    """The first executable of :func:`candidates`, looked up again after ``FOUND_TTL_S``: a start asks
    for it, and the lookup (a ``which`` over PATH, an access check per candidate) cost the server's
    loop ~1 ms per start during a burst (py-spy)."""
    key = (os.environ.get(ENV_EXE), None if settings is None else (settings.ns_criu, settings.cache_dir))
    now = time.monotonic()
    hit = _found.get(key)
    if hit is not None and now - hit[0] < FOUND_TTL_S:
        return hit[1]
    exe = next((p for p in candidates(settings) if os.access(p, os.X_OK)), None)
    _found[key] = (now, exe)
    return exe


def evaluate(exe: str | None, run: Runner = subprocess.run) -> CriuStatus:
    """Decide, without caching, whether ``exe`` is a CRIU we can use (``run`` is injectable for tests)."""
    if exe is None:
        return CriuStatus(None, None, False, "absent: no criu executable (process snapshots need CRIU >= 4.2)")
    try:
        out = run([exe, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return CriuStatus(exe, None, False, f"unusable: {exe} --version failed: {exc}")
    version = parse_version(out.stdout + out.stderr)
    if version is None:
        return CriuStatus(exe, None, False, f"unusable: cannot read the version of {exe}")
    vtext = ".".join(map(str, version))
    if version[:2] < MIN_VERSION:
        return CriuStatus(exe, version, False,
                          f"too old: criu {vtext} at {exe} (this kernel needs >= {MIN_VERSION[0]}.{MIN_VERSION[1]})")
    try:
        chk = run([exe, "check"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return CriuStatus(exe, version, False, f"unusable: criu {vtext} check failed: {exc}")
    if chk.returncode != 0:
        lines = [ln for ln in (chk.stderr + chk.stdout).splitlines() if ln.strip()]
        why = lines[-1].strip() if lines else f"exit {chk.returncode}"
        return CriuStatus(exe, version, False, f"unusable: criu {vtext} check failed: {why}")
    return CriuStatus(exe, version, True, f"criu {vtext} at {exe}")


_cache: dict[str | None, CriuStatus] = {}


def probe(refresh: bool = False, settings: Settings | None = None) -> CriuStatus:
    """The (cached) status of the CRIU this process would use."""
    exe = find_exe(settings)
    if refresh or exe not in _cache:
        _cache[exe] = evaluate(exe)
    return _cache[exe]


def masked_here() -> tuple[str, ...]:
    """The /proc files a sandbox on this host masks with /dev/null (``launch.harden_proc`` masks those
    that exist): each one is a bind of a host node, so an external mount for CRIU."""
    return tuple(n for n in PROC_MASKED if os.path.exists(f"/proc/{n}"))


def _masks(masked: Sequence[str]) -> list[tuple[str, str]]:
    """(mount point in the sandbox, key) of every ``/dev/null`` bind: device nodes and /proc masks."""
    return [(f"/dev/{n}", f"dev-{n}") for n in DEV_NODES] + [(f"/proc/{n}", f"proc-{n}") for n in masked]


def _externals_dump(masked: Sequence[str], net_inode: int | None) -> list[str]:
    out = ["--external", f"mnt[/.aenv]:{EXT_TOOLS}", "--external", f"mnt[/.aenv-run]:{EXT_RUN}",
           "--external", f"mnt[{BOOT_ID_MOUNT}]:{EXT_BOOT_ID}"]
    for point, key in _masks(masked):
        out += ["--external", f"mnt[{point}]:{key}"]
    if net_inode is not None:
        out += ["--external", f"net[{net_inode}]:{EXT_NET}"]
    return out


def volume_key(point: str) -> str:
    """The external key of a volume mounted at ``point``: named by its place, so a restore maps each
    dumped volume bind to a source whatever order its sandbox lists them in."""
    return EXT_VOLUME + hashlib.sha256(point.encode()).hexdigest()[:16]


def _volumes_dump(points: Sequence[str]) -> list[str]:
    return [a for p in points for a in ("--external", f"mnt[{p}]:{volume_key(p)}")]


def _volumes_restore(sources: Sequence[tuple[str, str]]) -> list[str]:
    """``(mount point, host source)`` of each volume a restore binds where the dumped one was."""
    return [a for point, src in sources for a in ("--external", f"mnt[{volume_key(point)}]:{src}")]


def _externals_restore(tools: Path, run_dir: Path, boot_id: Path | None, masked: Sequence[str]) -> list[str]:
    out = ["--external", f"mnt[{EXT_TOOLS}]:{tools}", "--external", f"mnt[{EXT_RUN}]:{run_dir}"]
    if boot_id is not None:
        out += ["--external", f"mnt[{EXT_BOOT_ID}]:{boot_id}"]
    for point, key in _masks(masked):
        out += ["--external", f"mnt[{key}]:{'/dev/null' if point.startswith('/proc/') else point}"]
    return out


def dump_argv(exe: str, pid: int, images: Path, *, freezer: Path | None, log: str = "dump.log",
              leave_running: bool = True, net_inode: int | None = None,
              masked: Sequence[str] | None = None, dev_external: bool = False,
              volumes: Sequence[str] = (), empty_net: bool = False) -> list[str]:
    """``criu dump`` of the process tree rooted at the sandbox init (host ``pid``).

    ``freezer``: the sandbox's freezer cgroup dir; the caller freezes it first so the tree is
    consistent with the upper copied right after, and CRIU then leaves it frozen. ``net_inode``: the
    inode of the sandbox's network namespace, dumped as external. ``masked``: the /proc files the
    sandbox has masked (those that exist on this host: ``launch.harden_proc``). ``dev_external``: a
    sandbox in a user namespace, whose /dev a restore cannot rebuild (see ``checkpoint.py``).
    ``volumes``: the mount points of the sandbox's E2B volumes, external too (a restore binds them
    again: the volume is shared, never copied into the images). ``empty_net``: the tree's own
    network namespace is taken as an empty one (``--empty-ns net``): its sockets are dumped, its
    links, addresses, routes, rules, iptables, nftables and sysctls are not (~145 of a ~230 ms
    dump: nine ``ip``/``iptables-save`` runs and the netlink walks), nor is a tap another process
    holds; ``restore_argv``'s ``empty_net`` brings back what the runtime needs."""
    argv = [exe, "dump", "-t", str(pid), "-D", str(images), "-o", log, "-v2", "--network-lock", "skip",
            "--tcp-established", SKIP_IN_FLIGHT, "--ext-unix-sk", "--file-locks", "--manage-cgroups=ignore",
            *_externals_dump(masked_here() if masked is None else masked, net_inode), *_volumes_dump(volumes)]
    if dev_external:
        argv += ["--external", f"mnt[/dev]:{EXT_DEV}"]
    if empty_net:
        argv += ["--empty-ns", "net"]
    if freezer is not None:
        argv += ["--freeze-cgroup", str(freezer)]
    if leave_running:
        argv.append("--leave-running")
    return argv


_FLAG_NAMES = ((MS_NOSUID, "nosuid"), (MS_NODEV, "nodev"), (MS_NOEXEC, "noexec"))
_BOOT_ID_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC
_TOOLS_FLAGS = MS_NOSUID | MS_NODEV


def mount_options(flags: int) -> list[str]:
    """The mount(8) option names of a read-only bind with ``flags`` (the MS_* bits besides read-only)."""
    return ["ro", *(name for bit, name in _FLAG_NAMES if flags & bit)]


def read_only_points(masked: Sequence[str], volumes: Sequence[str] = ()) -> list[str]:
    """``POINT:FLAGS`` of every host bind a restore must make read-only again (``ro_remount.py``),
    with the other flags the launcher gave it (``agent/launch.py``); ``volumes``: the mount points
    of the read-only volumes (a fork child's of its parent's read-write one among them)."""
    points = [f"{point}:0" for point, _ in _masks(masked)]
    return [*points, f"{BOOT_ID_MOUNT}:{_BOOT_ID_FLAGS}", f"/.aenv:{_TOOLS_FLAGS}",
            *(f"{p}:{VOLUME_FLAGS}" for p in volumes)]


VOLUME_FLAGS = MS_NOSUID | MS_NODEV  # what the launcher gives a volume bind besides read-only


def read_only_sources(tools: Path, boot_id: Path | None, masked: Sequence[str],
                      volumes: Sequence[str] = ()) -> list[tuple[str, int]]:
    """(host path, MS_* flags besides read-only) of every source of a read-only host bind of a
    restore (``_externals_restore``), each once. CRIU bind-mounts each source as it is, so the
    restore wrapper binds each one read-only over itself in CRIU's private mount namespace
    (``in_fresh_netns_argv``): every restored bind is born read-only, with its flags."""
    out: dict[str, int] = {}
    for point, _ in _masks(masked):
        src = "/dev/null" if point.startswith("/proc/") else point
        out[src] = out.get(src, 0)
    if boot_id is not None:
        out[str(boot_id)] = _BOOT_ID_FLAGS
    out[str(tools)] = _TOOLS_FLAGS
    for src in volumes:  # the read-only volumes' sources
        out[src] = VOLUME_FLAGS
    return list(out.items())


def _mount_points() -> set[str]:
    try:
        with open("/proc/self/mountinfo") as fh:
            return {line.split()[4] for line in fh if len(line.split()) > 4}
    except OSError:
        return set()


def _read_only_binds(sources: Sequence[tuple[str, int]]) -> str:
    """Shell commands binding each source read-only over itself (mount(8) runs ~1.5 ms each). The
    device nodes take one remount of ``/dev`` where it is a mount of its own and none of them is
    mounted over it (a container's bind of a host node): in CRIU's private namespace only."""
    points = _mount_points()
    nodes = [src for src, flags in sources if src.startswith("/dev/") and flags == 0]
    one_dev = "/dev" in points and not any(n in points for n in nodes)
    out = ["mount -o remount,bind,ro /dev && "] if one_dev and nodes else []
    for src, flags in sources:
        if not (one_dev and src in nodes):
            out.append(f"mount --bind -o {','.join(mount_options(flags))} {shlex.quote(src)} {shlex.quote(src)} && ")
    return "".join(out)


def _needs(masked: Sequence[str], volumes: Sequence[str] = ()) -> dict[str, list[str]]:
    """The read-only binds' mount points grouped by the options each must show (space-separated)."""
    need: dict[str, list[str]] = {}
    for arg in read_only_points(masked, volumes):
        point, _, flags = arg.rpartition(":")
        need.setdefault(" ".join(mount_options(int(flags))), []).append(point)
    return need


def _check_script(masked: Sequence[str], volumes: Sequence[str] = ()) -> str:
    """Shell that runs through the restored tree's mount table and calls the remount (``fix``) at
    the first host bind that lacks read-only or one of its flags, or when it cannot read the table."""
    arms = "".join(f"    {'|'.join(points)}) need='{opts}' ;;\n" for opts, points in _needs(masked, volumes).items())
    return ('table="/proc/$CRTOOLS_INIT_PID/mountinfo"\n'
            '[ -r "$table" ] || fix\n'
            'seen=0\n'
            'while read -r _ _ _ _ point opts _; do\n'
            '  case "$point" in\n'
            f'{arms}'
            '    *) continue ;;\n'
            '  esac\n'
            '  seen=1\n'
            '  for o in $need; do case ",$opts," in *",$o,"*) ;; *) fix ;; esac; done\n'
            'done < "$table"\n'
            '[ "$seen" = 1 ] || fix\n')


SETUP_NAMESPACES = "setup-namespaces"  # the stage at which the restored init's namespaces exist, nothing in them
# With ``--empty-ns net`` CRIU makes the restored network namespace and leaves it bare: the action
# script brings its loopback up before any socket is restored (each bound to 127.0.0.1 needs it).
LO_UP = (f'[ "$CRTOOLS_SCRIPT_ACTION" = {SETUP_NAMESPACES} ] && exec nsenter -t "$CRTOOLS_INIT_PID" -n '
         f'sh -c \'{{ echo 1 > {NONLOCAL_BIND} || :; }} 2>/dev/null; ip link set lo up && '
         f'{{ [ ! -e "$0" ] || {{ {STAND_IN_ROUTE}; }}; }}\' "$CRTOOLS_IMAGE_DIR/{OUTSIDE_TCP_MARK}"\n')


def ro_remount_action(masked: Sequence[str], base: Path = KDAT_BASE, volumes: Sequence[str] = (),
                      lo_up: bool = False, compiled: bool = True) -> str:
    """The ``--action-script`` that makes sure of it: CRIU execs a file (no arguments), written once
    into a root-only directory of the host (a sandbox's ``/.aenv-run`` would let the sandbox rewrite
    what the host runs as root). CRIU runs it at each of its seven stages and waits for it, so the
    shell does nothing but at ``pre-resume``, and there only checks the restored tree's mount table
    (the binds are born read-only: ``read_only_sources``); ``ro_remount.py`` remounts them should any
    be writable (a CRIU that binds otherwise). Each Python start is ~25 ms: seven of them were
    ~160 ms of a ~220 ms restore. Where a C compiler is around the same checks are a static program
    (``criu_action.py``): the shell's forks and ``ip`` runs were 23 ms of an 83 ms restore.
    ``compiled=False``: the shell form even so (tests compare the two)."""
    script = Path(__file__).with_name("ro_remount.py")
    fix_argv = (sys.executable, "-I", "-S", str(script), *read_only_points(masked, volumes))
    directory = base / f"aenv-criu-actions-{os.geteuid()}"
    directory.mkdir(mode=0o700, exist_ok=True)
    if directory.stat().st_uid != os.geteuid() or directory.stat().st_mode & 0o077:
        raise RuntimeError(f"{directory} is not this user's private directory")
    if compiled:
        needs = [(point, opts.split()) for opts, points in _needs(masked, volumes).items() for point in points]
        program = compiled_action(directory, conf_text(needs, fix_argv, (SLIRP_TAP_ADDR, OUTSIDE_TCP_MARK) if lo_up else None))
        if program is not None:
            return str(program)
    fix = " ".join(shlex.quote(a) for a in fix_argv)
    body = (f'#!/bin/sh\n{LO_UP if lo_up else ""}[ "$CRTOOLS_SCRIPT_ACTION" = {PRE_RESUME} ] || exit 0\n'
            f'fix() {{ exec {fix}; }}\n{_check_script(masked, volumes)}')
    path = directory / f"ro-remount-{hashlib.sha256(body.encode()).hexdigest()[:12]}.sh"
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.{secrets.token_hex(4)}.tmp")  # restores in parallel threads
        tmp.write_text(body)
        tmp.chmod(0o700)
        os.replace(tmp, path)
    return str(path)


def restore_argv(exe: str, images: Path, *, root: Path, pidfile: Path, tools: Path, run_dir: Path,
                 log: str = "restore.log", extra: Sequence[str] = (), boot_id: Path | None = None,
                 masked: Sequence[str] | None = None, net_external: bool = True,
                 dev: Path | None = None, volumes: Sequence[tuple[str, str]] = (),
                 read_only_volumes: Sequence[str] = (), empty_net: bool = False,
                 lazy_work: Path | None = None) -> list[str]:
    """``criu restore`` detached into ``root`` (a fresh overlay whose upper is a copy taken at dump
    time). Each restore gets a new pid namespace, so N restores of one image run side by side.
    ``boot_id``: the new sandbox's boot id file, bound where the dumped one was. ``net_external``:
    the image's network namespace was external; the restored tree joins the one open at ``NET_FD``
    (``in_fresh_netns_argv``). ``dev``: the fresh /dev of a user-namespaced sandbox (``dump_argv``'s
    ``dev_external``). ``volumes``: (mount point, host source) of each volume (``dump_argv``'s);
    ``read_only_volumes``: the mount points of those that must come back read-only (the action
    script sees to it: CRIU restores a bind with the dumped flags, a fork child's from a writer).
    ``empty_net``: the image's network namespace is made bare (``--empty-ns net``) but for its
    loopback (``LO_UP``): a user-namespaced sandbox's holds only loopback and its filter, which the
    runtime writes again after CRIU (``Restorer.attach`` in ``restored.py``); restoring its addresses, routes,
    rules and iptables took CRIU eight ``ip``/``iptables`` runs (~25 ms). ``lazy_work``: restore
    with ``--lazy-pages``, the pages served by the ``lazy_pages_argv`` daemon listening in that
    directory (CRIU's work dir: its socket has a fixed name, so one directory per restore)."""
    lazy = ["--lazy-pages", "-W", str(lazy_work)] if lazy_work is not None else []
    net = ["--inherit-fd", f"fd[{NET_FD}]:{EXT_NET}"] if net_external else []
    if empty_net:
        net += ["--empty-ns", "net"]
    if dev is not None:
        net += ["--external", f"mnt[{EXT_DEV}]:{dev}"]
    masked = masked_here() if masked is None else masked
    return [exe, "restore", "-D", str(images), "-o", log, "-v2", "--network-lock", "skip", "--restore-detached",
            "--pidfile", str(pidfile), "--root", str(root), "--tcp-established", "--ext-unix-sk",
            "--file-locks", "--manage-cgroups=ignore", *_externals_restore(tools, run_dir, boot_id, masked),
            "--action-script", ro_remount_action(masked, volumes=read_only_volumes, lo_up=empty_net), *net, *_volumes_restore(volumes),
            *lazy, *extra]


LAZY_SOCKET = "lazy-pages.socket"  # what CRIU names the lazy-pages daemon's socket in its work dir
LAZY_LOG = "lazy-pages.log"


def lazy_pages_argv(exe: str, images: Path, work: Path) -> list[str]:
    """``criu lazy-pages``: the daemon that serves one ``--lazy-pages`` restore of ``images`` by
    userfaultfd from ``work`` (its socket and log). It serves faults as they come, copies every page
    not yet asked for once no fault came for a second, and ends when all are in place."""
    return [exe, "lazy-pages", "-D", str(images), "-W", str(work), "-o", LAZY_LOG, "-v2"]


def kdat_dir(exe: str, base: Path = KDAT_BASE) -> Path:
    """Where ``exe``'s kernel probe is kept: one directory per executable (another build may lay
    its cache out differently; CRIU only checks two magic numbers and the size)."""
    return base / f"aenv-criu-{hashlib.sha256(exe.encode()).hexdigest()[:12]}"


def _kdat_prefix(kdat: Path | None) -> str:
    return f'mount --bind "{kdat}" /run && ' if kdat is not None else ""


def in_kdat_cache_argv(kdat: Path | None, argv: Sequence[str]) -> list[str]:
    """Run CRIU (``argv``) with ``/run`` bound to ``kdat`` (a tmpfs dir) in a private mount namespace,
    so its kernel probe is kept between runs (see the module doc). ``None``: run it as is."""
    if kdat is None:
        return list(argv)
    return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c",
            _kdat_prefix(kdat) + 'exec "$@"', "sh", *argv]


def in_fresh_netns_argv(argv: Sequence[str], kdat: Path | None = None,
                        read_only: Sequence[tuple[str, int]] = (), ready: bool = False,
                        stand_in_route: bool = False) -> list[str]:
    """Run ``argv`` in a new network namespace with loopback up and that namespace open at ``NET_FD``
    (what ``restore_argv(net_external=True)`` inherits), binding to absent addresses allowed until
    CRIU has ended (``NONLOCAL_BIND``), and with ``stand_in_route`` a default route through
    loopback (``OUTSIDE_TCP_MARK``). The namespace lives as long as the restored
    tree is in it; the runtime adds the filter and slirp4netns for internet access afterwards.
    ``kdat``: also a private mount namespace with CRIU's probe cache (``in_kdat_cache_argv``);
    ``read_only``: (path, MS_* flags) bound read-only over themselves in it (``read_only_sources``);
    ``ready``: print ``READY`` on stdout once the namespaces are made, then wait for a line on stdin
    before the exec (``checkpoint.run_criu`` sends it once its ``on_ready`` returned): while it
    waits, its pid surely names the fresh network namespace. Without the wait a quick restore could
    end, and its pid be reused, before the filter went in, which would then land in whatever
    namespace that pid's new owner has."""
    tell = f"echo {READY} && read -r _go && " if ready else ""
    route = f"{STAND_IN_ROUTE} && " if stand_in_route else ""
    script = (f'{_kdat_prefix(kdat)}{_read_only_binds(read_only)}ip link set lo up && {route}'
              f'{{ echo 1 > {NONLOCAL_BIND} || :; }} 2>/dev/null && {tell}'
              f'exec "$@" {NET_FD}</proc/self/ns/net' + (" </dev/null" if ready else ""))
    mount = ["--mount", "--propagation", "private"] if kdat is not None or read_only else []
    return ["unshare", "--net", *mount, "--", "/bin/sh", "-c", script, "sh", *argv]


def in_netns_of_argv(pid: int, argv: Sequence[str]) -> list[str]:
    """Run ``argv`` (a dump) in the network namespace of ``pid``. CRIU dumps every namespace of the
    tree that differs from its own, and an external network namespace still cost ~30 ms of each
    dump (CRIU reads its devices and sysctls, then records only the key); in the tree's own one it
    has none to dump, and a restore puts the tree in the namespace CRIU runs in (the fresh one of
    ``in_fresh_netns_argv``). Images dumped with the namespace external restore as before."""
    return ["nsenter", f"--net=/proc/{pid}/ns/net", "--", *argv]


def in_cgroups_argv(procs_files: Sequence[str], argv: Sequence[str]) -> list[str]:
    """Run ``argv`` after moving itself into the sandbox cgroups, so every restored task is born
    inside them (restore runs with ``--manage-cgroups=ignore``)."""
    script = 'n=$1; shift; i=0; while [ $i -lt "$n" ]; do echo $$ > "$1"; shift; i=$((i+1)); done; exec "$@"'
    return ["/bin/sh", "-c", script, "sh", str(len(procs_files)), *procs_files, *argv]


def overlay_options(lowers: Sequence[str], upper: Path, work: Path) -> str:
    return f"lowerdir={':'.join(lowers)},upperdir={upper},workdir={work}"


def mount_overlay_argv(lowers: Sequence[str], upper: Path, work: Path, target: Path) -> list[str]:
    """The host-side overlay mount ``criu restore --root`` needs (unmounted right after restore:
    the restored tree keeps its own copy in its mount namespace), as a command line; ``checkpoint``
    makes the same mount with mount(2), one exec fewer per restore."""
    return ["mount", "-t", "overlay", "overlay", "-o", overlay_options(lowers, upper, work), str(target)]

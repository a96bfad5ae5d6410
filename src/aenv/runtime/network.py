"""Sandbox networking, shared by both runtimes (a vm sandbox's QEMU runs in such a netns too:
``runtime/vm/netjail.py``).

Two modes, chosen per sandbox by ``allow_internet``:

* **loopback only** (``False``): the sandbox has its own empty network namespace; the launcher brings
  ``lo`` up and that is all. Nothing outside is reachable, including the host's 127.0.0.1.
* **outbound via slirp4netns** (``True``): a user-mode TCP/IP stack (Debian's ``slirp4netns``) attached
  to the sandbox's netns through a tap device. Chosen over a NAT'd veth because it needs no host
  network changes at all (no bridge, no iptables on the host, no ip_forward, nothing to leak after a
  crash except one process), and traffic leaves through ordinary host sockets. ``--disable-host-loopback``
  stops its gateway address from mapping to the host's 127.0.0.1; because slirp *would* still reach the
  host's own addresses and private ranges through ordinary sockets, an iptables ``OUTPUT`` filter is
  installed *inside* the sandbox's netns (by the host, via nsenter) that rejects them. The sandbox
  cannot remove it: its root has no CAP_NET_ADMIN (dropped from the bounding set by the launcher).

The operator's allowlist (``allowlist.py``, ``configure_private``) opens named private destinations in
that same filter. Where it exposes host services (``localhost:PORT``), slirp4netns starts without
``--disable-host-loopback``, so that its gateway 10.0.2.2 maps to the host's loopback; the filter then
accepts 10.0.2.2 at those ports alone and rejects the rest of it, before any other rule could open it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from aenv.runtime.allowlist import TAP_ADDR, Allowlist
from aenv.runtime.egress_own import OwnHosts
from aenv.runtime.netpolicy import EgressPolicy, render
from aenv.runtime.nsthread import run_in_namespace
from aenv.runtime.process import ProcRef, Reaped
from aenv.runtime.shaping import SHAPER, ShapingError

log = logging.getLogger("aenv.runtime.network")

SLIRP_GATEWAY = "10.0.2.2"
SLIRP_TAP_ADDR = TAP_ADDR  # what slirp4netns --configure gives the tap
SLIRP_DNS = "10.0.2.3"
RESOLV_CONF = f"nameserver {SLIRP_DNS}\n"
BLOCKED_RANGES = (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.0.0.0/24", "192.0.2.0/24", "192.168.0.0/16", "198.18.0.0/15", "224.0.0.0/4", "240.0.0.0/4",
)


class NetworkError(RuntimeError):
    pass


_SLIRP_TTL_S = 10.0
_slirp_seen: list[tuple[float, bool]] = []


def slirp_available() -> bool:
    """Whether slirp4netns and iptables-restore are on PATH, looked up again after ``_SLIRP_TTL_S``
    (every start asks; two ``which`` over PATH on the server's loop each time)."""
    now = time.monotonic()
    if not _slirp_seen or now - _slirp_seen[0][0] >= _SLIRP_TTL_S:
        _slirp_seen[:] = [(now, shutil.which("slirp4netns") is not None and shutil.which("iptables-restore") is not None)]
    return _slirp_seen[0][1]


def host_ipv4_addresses() -> list[str]:
    """Every IPv4 address configured on the host (so the filter can reject them explicitly)."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=False)
    addrs: list[str] = []
    for line in out.stdout.splitlines():
        parts = line.split()
        if "inet" in parts:
            addrs.append(parts[parts.index("inet") + 1].split("/")[0])
    return addrs


# Where sandboxes' DNS queries go: slirp4netns's resolver (which asks the host's), or the server's
# ``sandbox_dns`` setting, to which the filter redirects them (``configure_dns``).
_resolver = SLIRP_DNS


def configure_dns(server: str | None) -> None:
    """Send every sandbox's queries to ``server`` (an IPv4 address) instead of slirp's resolver."""
    global _resolver
    _resolver = str(ipaddress.IPv4Address(server)) if server else SLIRP_DNS


def resolver() -> str:
    return _resolver


# The operator's allowlist of private destinations (``private_egress``), the same for every sandbox.
_private = Allowlist()
_own: OwnHosts | None = None


def configure_private(allowlist: Allowlist) -> None:
    """Every filter written from now on opens what ``allowlist`` allows (set once, at start-up)."""
    global _private
    _private = allowlist


def private_allowlist() -> Allowlist:
    return _private


def configure_own(hosts: OwnHosts | None) -> None:
    """This server's sandbox hosts, for header rules that name one (set once, at start-up)."""
    global _own
    _own = hosts


def own_hosts() -> OwnHosts | None:
    return _own


def firewall_rules(host_addrs: list[str], policy: EgressPolicy | None = None, proxy_port: int | None = None,
                   jail: bool = False) -> str:
    """iptables-restore input for the sandbox netns: loopback and DNS allowed, the host and every
    private/special range rejected but for what the operator allows, the rest (the internet) allowed,
    unless ``policy`` says otherwise (``netpolicy.render``). ``jail``: a vm's QEMU namespace."""
    own = _own.ports(policy.rules) if _own is not None and policy is not None else ()
    return render(host_addrs, BLOCKED_RANGES, _resolver, SLIRP_DNS, policy, proxy_port, _private, jail, own)


# The iptables backend every sandbox namespace of this server is written with (``restore_tool``).
LEGACY_RESTORE, NFT_RESTORE = "iptables-legacy-restore", "iptables-restore"
_restore_tool: str | None = None


def _restore(argv: list[str], rules: str, pid: int | None = None) -> tuple[int, str]:
    """Run ``argv`` (an iptables restore) on ``rules``; with ``pid``, spawned from a thread inside
    ``pid``'s network namespace (a child starts in its parent thread's namespaces): no ``nsenter`` exec,
    and the event loop never waits for a fork or an exit."""

    def run(_libc: object = None) -> tuple[int, str]:
        proc = subprocess.run(argv, input=rules.encode(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              check=False)
        return proc.returncode, proc.stderr.decode(errors="replace").strip()

    return run() if pid is None else run_in_namespace(pid, "net", run, thread_name=f"iptables-{pid}")


def probe_rules() -> str:
    """A filter with every match and target ``render`` can write (DNS redirect, proxy redirect,
    conntrack, REJECT), to try a backend on in a namespace of its own."""
    probe = EgressPolicy(allow_domains=("example.com",), deny_nets=(ipaddress.IPv4Network("0.0.0.0/0"),))
    return render(["192.0.2.1"], BLOCKED_RANGES, "192.0.2.53", SLIRP_DNS, probe, 1)


async def restore_tool() -> str:
    """``iptables-legacy-restore`` where it works here, else ``iptables-restore`` (nf_tables); chosen once.

    Why: the nf_tables backend commits each table in a transaction of its own, and closing a
    netfilter netlink socket after a commit waits for the kernel to free the old rules (an RCU grace
    period, ~15 ms on a 2-vCPU VM): a restore of both tables took 20-30 ms, 40-50 ms beside the
    pool's. The legacy backend swaps each table in one ``setsockopt``: 4-5 ms, most of it the execs.
    One backend for every namespace, so a rewrite always replaces what the last one wrote."""
    global _restore_tool
    if _restore_tool is None:
        tool = NFT_RESTORE
        if shutil.which(LEGACY_RESTORE) is not None and shutil.which("unshare") is not None:
            code, _ = await asyncio.to_thread(_restore, ["unshare", "--net", LEGACY_RESTORE], probe_rules())
            tool = LEGACY_RESTORE if code == 0 else NFT_RESTORE
        _restore_tool = tool
    return _restore_tool


class Restorer:
    """An iptables restore started ahead in a pooled sandbox's namespace, waiting on its stdin: at
    hand-out a policy then costs a parse and two table swaps (~1.5 ms) instead of a fork and an exec
    too (~3 ms, on the create's path). Given no rules (``discard``) it exits having changed nothing."""

    def __init__(self, proc: subprocess.Popen[bytes], tool: str) -> None:
        self.proc, self.tool = proc, tool

    @classmethod
    async def start(cls, pid: int) -> Restorer:
        tool = await restore_tool()

        def spawn(_libc: object) -> subprocess.Popen[bytes]:
            return subprocess.Popen([tool], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

        return cls(await asyncio.to_thread(run_in_namespace, pid, "net", spawn, thread_name=f"iptables-{pid}"), tool)

    def run(self, rules: str) -> tuple[int, str]:
        """Blocking: ``rules`` written, the process reaped; (exit status, stderr). Once only."""
        _, err = self.proc.communicate(rules.encode())
        return self.proc.returncode, err.decode(errors="replace").strip()

    def discard(self) -> None:
        """Blocking, idempotent, never raises: it exits, nothing written."""
        with contextlib.suppress(Exception):
            if self.proc.returncode is None:
                self.run("")


_FLUSHED = ("*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n"
            "*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\nCOMMIT\n")


async def foreign_rules(pid: int) -> bool:
    """Whether ``pid``'s namespace holds nf_tables rules while this server writes legacy ones: a
    sandbox filtered by a server before the legacy backend (adopted after an upgrade). A packet must
    pass both, so they are never looser, but an update could not loosen past them."""
    if await restore_tool() != LEGACY_RESTORE or shutil.which("iptables-nft-save") is None:
        return False

    def save(_libc: object) -> str:
        return subprocess.run(["iptables-nft-save"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              check=False).stdout

    try:
        out = await asyncio.to_thread(run_in_namespace, pid, "net", save, thread_name=f"iptables-{pid}")
    except OSError:
        return False
    return any(line.startswith("-A ") for line in out.splitlines())


async def drop_foreign_rules(pid: int) -> None:
    """Empty the nf_tables filter and nat of ``pid``'s namespace (``foreign_rules``), once the legacy
    filter is in force there: only the legacy one decides from then on."""
    code, err = await asyncio.to_thread(_restore, [NFT_RESTORE], _FLUSHED, pid)
    if code != 0:
        raise NetworkError(f"{NFT_RESTORE} in sandbox netns failed: {err}")


def known_tool() -> str | None:
    """The backend ``restore_tool`` chose, None before it has."""
    return _restore_tool


def write_firewall(tool: str, pid: int, host_addrs: list[str], policy: EgressPolicy | None = None,
                   proxy_port: int | None = None, restorer: Restorer | None = None, jail: bool = False) -> None:
    """Blocking: replace the filter of ``pid``'s network namespace (both tables) with ``tool``, through
    ``restorer`` if one was started there (a fresh restore if it fails: it may have been killed)."""
    rules = firewall_rules(host_addrs, policy, proxy_port, jail)
    code, err = -1, ""
    if restorer is not None:
        with contextlib.suppress(OSError, ValueError):
            code, err = restorer.run(rules)
    try:
        if code != 0:
            code, err = _restore([tool], rules, pid)
    except OSError as exc:  # the namespace is gone, or the tool is
        raise NetworkError(f"{tool} in sandbox netns failed: {exc}") from exc
    if code != 0:
        raise NetworkError(f"{tool} in sandbox netns failed: {err}")


async def install_firewall(pid: int, host_addrs: list[str], policy: EgressPolicy | None = None,
                           proxy_port: int | None = None, restorer: Restorer | None = None,
                           jail: bool = False) -> None:
    """``write_firewall`` with the backend of every namespace, on a worker thread."""
    tool = await restore_tool()
    await asyncio.to_thread(write_firewall, tool, pid, host_addrs, policy, proxy_port, restorer, jail)


@dataclass
class Slirp:
    """One slirp4netns process serving one sandbox. Owned by the sandbox; ``aclose`` is idempotent."""

    ref: ProcRef
    child: Reaped | None = None  # None after a server restart (not our child any more)
    target: ProcRef | None = None  # the process whose network namespace it serves (the sandbox's init)

    @classmethod
    async def start(cls, pid: int, timeout: float = 5.0, exit_fd: int | None = None, key: str = "",
                    again: bool = False) -> Slirp:
        """slirp4netns for the network namespace of ``pid``, once its tap is up. ``exit_fd``: the
        read end of a pipe; slirp4netns exits when its last write end closes (vm: QEMU holds it).
        ``key``: the sandbox (or pool name) the namespace is made for: its bandwidth limits are on
        the tap before slirp4netns attaches (``shaping.py``); ``again``: the namespace had one before."""
        if again or not SHAPER.limits(key).unlimited:
            try:
                await asyncio.to_thread(SHAPER.prepare, key, pid, again)
            except ShapingError as exc:
                raise NetworkError(f"bandwidth limits: {exc}") from exc
        rfd, wfd = os.pipe()
        extra = [] if exit_fd is None else ["--exit-fd", str(exit_fd)]
        if not _private.host_ports:  # else 10.0.2.2 is the host's loopback, open only at those ports
            extra.append("--disable-host-loopback")
        try:
            child = await Reaped.spawn_off_loop(
                ["slirp4netns", "--configure", "--mtu=65520", "--ready-fd", str(wfd), *extra, str(pid), "tap0"],
                pass_fds=(wfd,) if exit_fd is None else (wfd, exit_fd), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
        finally:
            os.close(wfd)
        try:
            loop = asyncio.get_running_loop()
            ready = loop.create_future()

            def on_ready() -> None:
                if not ready.done():
                    ready.set_result(os.read(rfd, 16))

            loop.add_reader(rfd, on_ready)
            try:
                async with asyncio.timeout(timeout):
                    data = await ready
            finally:
                loop.remove_reader(rfd)
            if data != b"1":
                raise NetworkError("slirp4netns exited before it was ready")
        except BaseException:
            await child.aclose()
            raise
        finally:
            os.close(rfd)
        ref = ProcRef.of(child.pid)
        if ref is None:
            await child.aclose()
            raise NetworkError("slirp4netns vanished")
        slirp = cls(ref, child, ProcRef.of(pid))
        _SERVING[ref.pid] = slirp
        return slirp

    async def aclose(self) -> None:
        _SERVING.pop(self.ref.pid, None)
        self.ref.kill()
        if self.child is not None:
            await self.child.aclose()
        else:
            await self.ref.wait_gone_async(5.0)


_SERVING: dict[int, Slirp] = {}  # every slirp4netns this process started and has not closed, by pid


async def close_orphaned_slirps() -> list[int]:
    """Close every slirp4netns this process started whose sandbox is gone (its target process ended):
    slirp4netns does not exit with the namespace it serves, so one whose sandbox went another way than
    through its owner's ``aclose`` (a start that failed late, a race with a kill) would run forever.
    Returns their pids."""
    for pid, slirp in list(_SERVING.items()):
        if not slirp.ref.alive():  # it ended by itself (a vm's exits with its QEMU)
            _SERVING.pop(pid, None)
    gone = [s for s in list(_SERVING.values()) if s.target is not None and not s.target.alive()]
    for slirp in gone:
        assert slirp.target is not None
        log.warning("slirp4netns %d outlived the sandbox it served (pid %d): closed", slirp.ref.pid,
                    slirp.target.pid)
        await slirp.aclose()
    return [s.ref.pid for s in gone]


def kill_slirps_serving(pids: set[int]) -> list[int]:
    """SIGKILL every slirp4netns whose target PID (its last numeric argument) is in ``pids``.

    For sandboxes whose slirp pid was never recorded (the server died between spawning it and writing
    ns.json): slirp4netns is outside the sandbox's cgroup and does not exit when its netns goes away."""
    killed: list[int] = []
    if not pids:
        return killed
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if not argv or not argv[0].endswith(b"slirp4netns"):
            continue
        targets = [int(a) for a in argv[1:] if a.isdigit()]
        if targets and targets[-1] in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
    return killed

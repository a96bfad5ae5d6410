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
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from aenv.runtime.netpolicy import EgressPolicy, render
from aenv.runtime.process import ProcRef, Reaped

SLIRP_GATEWAY = "10.0.2.2"
SLIRP_DNS = "10.0.2.3"
RESOLV_CONF = f"nameserver {SLIRP_DNS}\n"
BLOCKED_RANGES = (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.0.0.0/24", "192.0.2.0/24", "192.168.0.0/16", "198.18.0.0/15", "224.0.0.0/4", "240.0.0.0/4",
)


class NetworkError(RuntimeError):
    pass


def slirp_available() -> bool:
    return shutil.which("slirp4netns") is not None and shutil.which("iptables-restore") is not None


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


def firewall_rules(host_addrs: list[str], policy: EgressPolicy | None = None, proxy_port: int | None = None) -> str:
    """iptables-restore input for the sandbox netns: loopback and DNS allowed, the host and every
    private/special range rejected, the rest (the internet) allowed, unless ``policy`` says otherwise
    (``netpolicy.render``)."""
    return render(host_addrs, BLOCKED_RANGES, _resolver, SLIRP_DNS, policy, proxy_port)


async def install_firewall(pid: int, host_addrs: list[str], policy: EgressPolicy | None = None,
                           proxy_port: int | None = None) -> None:
    """Replace the filter of ``pid``'s network namespace (both tables, atomically)."""
    proc = await asyncio.create_subprocess_exec(
        "nsenter", f"--net=/proc/{pid}/ns/net", "iptables-restore",
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    _, err = await proc.communicate(firewall_rules(host_addrs, policy, proxy_port).encode())
    if proc.returncode != 0:
        raise NetworkError(f"iptables-restore in sandbox netns failed: {err.decode(errors='replace').strip()}")


@dataclass
class Slirp:
    """One slirp4netns process serving one sandbox. Owned by the sandbox; ``aclose`` is idempotent."""

    ref: ProcRef
    child: Reaped | None = None  # None after a server restart (not our child any more)

    @classmethod
    async def start(cls, pid: int, timeout: float = 5.0, exit_fd: int | None = None) -> Slirp:
        """slirp4netns for the network namespace of ``pid``, once its tap is up. ``exit_fd``: the
        read end of a pipe; slirp4netns exits when its last write end closes (vm: QEMU holds it)."""
        rfd, wfd = os.pipe()
        extra = [] if exit_fd is None else ["--exit-fd", str(exit_fd)]
        try:
            child = Reaped.spawn(
                ["slirp4netns", "--configure", "--mtu=65520", "--disable-host-loopback",
                 "--ready-fd", str(wfd), *extra, str(pid), "tap0"],
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
        return cls(ref, child)

    async def aclose(self) -> None:
        self.ref.kill()
        if self.child is not None:
            await self.child.aclose()
        else:
            await self.ref.wait_gone_async(5.0)


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

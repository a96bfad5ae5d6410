"""Keep a vm sandbox's internet off the host: QEMU runs in a network namespace of its own.

QEMU's user-mode network (slirp) makes the guest's connections from the QEMU process itself and maps
the guest's 10.0.2.2 to 127.0.0.1, so a QEMU in the host's namespace would hand the guest the host's
loopback (the aenv API, a registry, anything listening) and every host address. A QEMU with internet
therefore starts under ``unshare --net``: its only way out is a slirp4netns with
``--disable-host-loopback`` behind the same in-namespace ``OUTPUT`` filter as an ns sandbox (no host
address, no private or special range), and the guest's 10.0.2.2 lands on that namespace's empty
loopback (or, for the ports the operator exposes as host services, is forwarded by the filter to
slirp4netns's gateway, the host's loopback: ``allowlist.py``). The guest and its device state are unchanged (the netdev stays ``user``), so templates,
snapshots and forks stay compatible; restores, forks and resumes are new QEMUs and get their own jail.

DNS: libslirp forwards the guest's queries to the nameserver in ``/etc/resolv.conf`` as QEMU sees
it; the host's (often a private or loopback address) is unreachable from the namespace, so QEMU also
gets a mount namespace in which ``/etc/resolv.conf`` names slirp4netns's resolver (10.0.2.3), which
asks the host's resolver from the host's side, exactly as for an ns sandbox.

slirp4netns ends with QEMU: QEMU holds the only write end of a pipe whose read end is
slirp4netns's ``--exit-fd``, so a QEMU that is killed, crashes, or outlives a restarted server
never leaves a slirp behind.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from aenv.runtime.egress import ENFORCER
from aenv.runtime.network import RESOLV_CONF, Slirp, host_ipv4_addresses, slirp_available
from aenv.runtime.shaping import SHAPER, ShapingError

# ``$0`` is the resolv.conf to show QEMU; a host without one has no resolver to hide.
_ENTER = 'if [ -e /etc/resolv.conf ]; then mount --bind "$0" /etc/resolv.conf || exit 97; fi; exec "$@"'
_HOST_ADDRS_TTL = 30.0
_host_addrs: tuple[float, list[str]] | None = None


class JailError(RuntimeError):
    """The namespace, its filter or its slirp4netns could not be set up."""


def available() -> bool:
    return slirp_available()


def jailed_argv(argv: list[str], resolv_conf: Path) -> list[str]:
    """``argv`` run in new network and mount namespaces (mounts from the host still propagate in)."""
    return ["unshare", "--net", "--mount", "--propagation", "slave", "--",
            "sh", "-c", _ENTER, str(resolv_conf), *argv]  # fmt: skip


def write_resolv_conf(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(RESOLV_CONF)


def host_addresses() -> list[str]:
    """The host's IPv4 addresses, re-read at most every 30 s (each spawn filters them out)."""
    global _host_addrs
    now = time.monotonic()
    if _host_addrs is None or now - _host_addrs[0] > _HOST_ADDRS_TTL:
        _host_addrs = (now, host_ipv4_addresses())
    return _host_addrs[1]


def _in_own_netns(pid: int) -> bool:
    """True once ``pid`` has left the server's network namespace (``unshare`` ran)."""
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino != os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return False


async def connect(pid: int, exit_fd: int, key: str = "", timeout: float = 5.0) -> Slirp:
    """Filter, then slirp4netns, for the jailed process ``pid`` (filter first: the tap, and so any
    route out, only exists once slirp is up). ``exit_fd`` is handed to slirp4netns and closed here.
    ``key``: the sandbox the QEMU runs; its egress policy, if one is registered, is in that filter."""
    try:
        async with asyncio.timeout(timeout):
            while not _in_own_netns(pid):  # never set up the host's own namespace by mistake
                if not Path(f"/proc/{pid}").exists():
                    raise JailError(f"process {pid} exited before entering its network namespace")
                await asyncio.sleep(0.001)
        addrs = await asyncio.to_thread(host_addresses)
        await ENFORCER.install(key, pid, addrs, jail=True)
        return await Slirp.start(pid, exit_fd=exit_fd, key=key)
    except TimeoutError as exc:
        raise JailError(f"process {pid} did not enter its own network namespace in {timeout:.0f} s") from exc
    except (RuntimeError, OSError) as exc:  # NetworkError: iptables-restore or slirp4netns failed
        if isinstance(exc, JailError):
            raise
        raise JailError(str(exc)) from exc
    finally:
        os.close(exit_fd)


async def reshape(key: str, pid: int) -> None:
    """The jail of ``pid``, made under a pool's name with the default bandwidth limits, given
    ``key``'s where they differ (before the sandbox is handed out: ``shaping.py``)."""
    if SHAPER.custom(key):
        try:
            await asyncio.to_thread(SHAPER.apply, key, pid)
        except ShapingError as exc:
            raise JailError(f"bandwidth limits: {exc}") from exc

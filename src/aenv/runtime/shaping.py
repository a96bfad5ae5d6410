"""Per-sandbox bandwidth limits: Linux traffic control in the sandbox's network namespace.

Where. A sandbox with internet access (and a vm's QEMU jail, ``vm/netjail.py``) reaches anything
outside through one device, ``tap0``, whose other end is slirp4netns (``network.py``). What the
namespace sends through it (uploads, requests) is the sandbox's *egress*: a token bucket (``tbf``) is
tap0's root qdisc. What slirp4netns writes into it (downloads, replies) is its *ingress*: tap0's
ingress qdisc redirects every packet (``u32`` match-all, ``mirred``) to an ``ifb`` device of the same
namespace whose root ``tbf`` shapes it. Shaped, not policed: a queue rather than drops, so TCP settles
at the rate instead of sawing under it (and this host's kernel has no ``police`` action). The burst
is at least two packets of the tap's 64 KiB MTU, else a full-size packet could never pass.

When. The host makes tap0 itself (persistent, with its qdiscs) *before* slirp4netns starts, and
slirp4netns attaches to the existing device by name: the limit is there before the namespace has any
route out, for every namespace a sandbox gets (a launch, a pool's, a CRIU restore, a fork child, a
vm's QEMU restored or resumed from disk). A sandbox taken from a pool was shaped with the server's
default under its pool name; one created with other limits is rewritten (``apply``) before it is
handed out. Only the host writes these: the sandbox's root has no CAP_NET_ADMIN. Sandboxes outlive a
server restart with their namespaces and qdiscs; one whose slirp4netns died meanwhile gets a fresh
tap with its limits before the new slirp4netns attaches (``prepare(again=True)``).

Not limited: a sandbox's ports reached through the server's proxy (a mux stream over a unix socket
on ns, virtio-serial on vm: no network device on the way) and its loopback. A sandbox without
internet access has no tap and nothing to limit. On vm the limit applies to QEMU's own sockets in the
jail (libslirp ends the guest's TCP there): the guest sees the same rate.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import shutil
import socket
import struct
import subprocess
from dataclasses import dataclass

from aenv.errors import InvalidRequest
from aenv.runtime.nsthread import run_in_namespace

log = logging.getLogger("aenv.runtime.shaping")

TAP = "tap0"
IFB = "ifb0"
TAP_MTU = 65520
MIN_BURST = 2 * (TAP_MTU + 16)  # bytes: two full packets and their link headers
BURST_SECONDS = 0.02  # the bucket holds 20 ms of the rate when that is more
QUEUE_SECONDS = 0.2  # the queue behind it: enough for TCP to stay at the rate, not a bufferbloat

_TUNSETIFF, _TUNSETPERSIST = 0x400454CA, 0x400454CB
_IFF_TAP, _IFF_NO_PI = 0x0002, 0x1000


class ShapingError(RuntimeError):
    """tc could not write a sandbox's limits (its network must not come up without them)."""


@dataclass(frozen=True)
class Bandwidth:
    """A sandbox's limits in Mbit/s (10^6 bits); None: that direction is not limited."""

    egress_mbit: float | None = None
    ingress_mbit: float | None = None

    @property
    def unlimited(self) -> bool:
        return self.egress_mbit is None and self.ingress_mbit is None

    def describe(self) -> dict[str, float | None]:
        return {"egressMbit": self.egress_mbit, "ingressMbit": self.ingress_mbit}


UNLIMITED = Bandwidth()


def of(egress_mbit: float | None, ingress_mbit: float | None) -> Bandwidth:
    """A ``Bandwidth`` from settings or a request, where 0 or None mean unlimited."""
    return Bandwidth(egress_mbit or None, ingress_mbit or None)


def _tbf(dev: str, mbit: float) -> str:
    rate_bytes = mbit * 1e6 / 8
    burst = max(MIN_BURST, int(rate_bytes * BURST_SECONDS))
    limit = burst + max(MIN_BURST, int(rate_bytes * QUEUE_SECONDS))
    return f"qdisc replace dev {dev} root handle 1: tbf rate {round(mbit * 1000)}kbit burst {burst} limit {limit}"


def render(bw: Bandwidth, fresh: bool) -> tuple[list[str], list[str]]:
    """``tc -batch`` lines for ``bw`` on tap0: (what to remove first, where it may not exist; what to
    write, each line of which must succeed). ``fresh``: tap0 was just made and has no qdiscs."""
    clear = [] if fresh else [f"qdisc del dev {TAP} root", f"qdisc del dev {TAP} ingress"]
    write: list[str] = []
    if bw.egress_mbit is not None:
        write.append(_tbf(TAP, bw.egress_mbit))
    if bw.ingress_mbit is not None:
        write += [
            _tbf(IFB, bw.ingress_mbit),
            f"qdisc add dev {TAP} handle ffff: ingress",
            f"filter add dev {TAP} parent ffff: protocol all prio 1 u32 match u32 0 0 "
            f"action mirred egress redirect dev {IFB}",
        ]
    return clear, write


def _exists(name: str) -> bool:
    """Whether the calling thread's network namespace has a device ``name`` (a socket of this thread
    is of its namespace; ``/sys/class/net`` would be of the process's)."""
    try:
        socket.if_nametoindex(name)
        return True
    except OSError:
        return False


def _make_tap() -> None:
    """tap0 in the calling thread's namespace, persistent, flagged as slirp4netns opens it (so its
    ``TUNSETIFF`` attaches to this one rather than failing)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", TAP.encode(), _IFF_TAP | _IFF_NO_PI))
        fcntl.ioctl(fd, _TUNSETPERSIST, 1)
    finally:
        os.close(fd)


def _drop_tap() -> None:
    """The calling thread's namespace's tap0, if a persistent one nobody holds is there, removed (its
    qdiscs and the ifb's redirect with it)."""
    if not _exists(TAP):
        return
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", TAP.encode(), _IFF_TAP | _IFF_NO_PI))
        fcntl.ioctl(fd, _TUNSETPERSIST, 0)  # gone when this fd closes
    finally:
        os.close(fd)


def _run(argv: list[str], lines: list[str]) -> tuple[int, str]:
    proc = subprocess.run(argv, input="\n".join(lines) + "\n", capture_output=True, text=True, check=False)
    return proc.returncode, proc.stderr.strip()


def _write_here(bw: Bandwidth, make_tap: bool) -> None:
    """Blocking, in the namespace to shape: tap0 (made if ``make_tap`` and absent), the ifb if ingress
    is limited, then the qdiscs. Raises ``ShapingError``."""
    fresh = False
    if make_tap and not _exists(TAP):
        try:
            _make_tap()
        except OSError as exc:
            raise ShapingError(f"cannot make {TAP}: {exc}") from exc
        fresh = True
    if bw.ingress_mbit is not None and not _exists(IFB):
        code, err = _run(["ip", "-batch", "-"], [f"link add {IFB} type ifb", f"link set {IFB} up"])
        if code != 0:
            raise ShapingError(f"cannot make {IFB}: {err}")
    clear, write = render(bw, fresh)
    if clear:
        _run(["tc", "-force", "-batch", "-"], clear)  # what is not there need not go
    if write:
        code, err = _run(["tc", "-batch", "-"], write)
        if code != 0:
            raise ShapingError(f"tc: {err}")


def write(pid: int, bw: Bandwidth, make_tap: bool = True) -> None:
    """Blocking: ``bw`` on tap0 of ``pid``'s network namespace (tap0 made there first if it has none
    and ``make_tap``), from a thread that enters the namespace and ends."""
    try:
        run_in_namespace(pid, "net", lambda _libc: _write_here(bw, make_tap), thread_name=f"tc-{pid}")
    except OSError as exc:  # the namespace is gone
        raise ShapingError(f"network namespace of {pid}: {exc}") from exc


def probe() -> str | None:
    """Why this host cannot shape (None: it can): every step of ``write`` tried in a throwaway
    network namespace (``unshare --net``), the ifb and the ``u32``/``mirred`` redirect included."""
    for tool in ("tc", "ip", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (iproute2, util-linux)"
    _, lines = render(Bandwidth(10.0, 10.0), fresh=True)
    script = (f"ip tuntap add {TAP} mode tap && ip link add {IFB} type ifb && ip link set {IFB} up && "
              "tc -batch - <<'EOF'\n" + "\n".join(lines) + "\nEOF\n")
    proc = subprocess.run(["unshare", "--net", "sh", "-ec", script], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return f"traffic control does not work here: {proc.stderr.strip() or proc.returncode}"
    return None


class Shaper:
    """The limits of every sandbox by key (sandbox ID, or a pool's name: the default), and the
    server's default. One per server (``SHAPER``), shared by both runtimes."""

    def __init__(self) -> None:
        self.default = UNLIMITED
        self._limits: dict[str, Bandwidth] = {}
        self._probed: str | None | bool = False  # False: not yet asked

    def configure(self, default: Bandwidth) -> None:
        """The server's default (set at start-up; a pool launched from then on has it)."""
        self.default = default

    def unavailable(self) -> str | None:
        """Why limits cannot be enforced on this host, None if they can (probed once, blocking)."""
        if self._probed is False:
            self._probed = probe()
        return self._probed if isinstance(self._probed, str) else None

    def register(self, key: str, bw: Bandwidth | None) -> None:
        """``key``'s own limits (None: the server's default) for every namespace made for it from now on."""
        if bw is None:
            self._limits.pop(key, None)
        else:
            self._limits[key] = bw

    def forget(self, key: str) -> None:
        self._limits.pop(key, None)

    def limits(self, key: str) -> Bandwidth:
        return self._limits.get(key, self.default)

    def custom(self, key: str) -> bool:
        """Whether ``key`` has limits other than the default (a pooled namespace must be rewritten)."""
        return self.limits(key) != self.default

    def prepare(self, key: str, pid: int, again: bool = False) -> None:
        """Blocking, before slirp4netns attaches to ``pid``'s namespace: tap0 with ``key``'s limits.
        Unlimited: nothing (slirp4netns makes its own tap). ``again``: the namespace had a
        slirp4netns before, which died (found so after a restart): a tap of ours outlives it with the
        address and route it configured, on which a new ``slirp4netns --configure`` fails (EEXIST), so
        it goes first and a fresh one is made."""
        bw = self.limits(key)
        if again:
            try:
                run_in_namespace(pid, "net", lambda _libc: _drop_tap(), thread_name=f"tc-{pid}")
            except OSError as exc:
                raise ShapingError(f"cannot remove the old {TAP}: {exc}") from exc
        if not bw.unlimited:
            write(pid, bw)

    def apply(self, key: str, pid: int) -> None:
        """Blocking: ``key``'s limits on the tap ``pid``'s namespace already has (a pooled one at
        hand-out, made under the pool's name with the default)."""
        write(pid, self.limits(key), make_tap=False)


SHAPER = Shaper()


async def register(key: str, bw: Bandwidth | None) -> None:
    """``SHAPER.register``, refused (``InvalidRequest`` naming ``bandwidth``) where this host cannot
    shape: a sandbox must never run without the limits it was created with."""
    if bw is not None and not bw.unlimited:
        reason = await asyncio.to_thread(SHAPER.unavailable)
        if reason is not None:
            raise InvalidRequest(f"bandwidth: {reason}")
    SHAPER.register(key, bw)

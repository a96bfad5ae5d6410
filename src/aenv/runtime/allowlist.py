"""The operator's allowlist of private destinations (the server's ``private_egress`` setting): what
sandboxes may reach beyond the base filter, which refuses every private range and the host
(``network.py``). Pure: parsing, and the ``iptables`` lines the filter gets; ``netpolicy.render``
places them.

Each entry is ``[named:]DEST[:PORT]``:

* ``DEST`` an IPv4 address, a CIDR block or a host name (resolved by the host when the server
  starts, every A record); without ``PORT`` every port of it (TCP and UDP), with it that port alone;
* ``localhost:PORT`` (or ``127.0.0.1:PORT``): a service on the host's loopback, which sandboxes then
  reach at :data:`HOST_SERVICES`\\ ``:PORT`` and at no other port (the single-node "model server on
  this host" case);
* ``named:`` in front: only sandboxes whose ``allowOut`` names the destination (an address or CIDR
  inside ``DEST``, or ``10.0.2.2`` for a host service) reach it. Without it every sandbox does,
  unless its ``denyOut`` overlaps the entry (then it too must name it).

Never opened, whatever an entry says: the host's own addresses (its services only through a named
port at ``10.0.2.2``), aenv's own ports there (the API's; in a cluster the directory's and the node
URLs'), those ports on a whole range an entry opens,
the sandbox's own virtual network ``10.0.2.0/24`` (slirp's gateway and resolver), and link-local,
multicast and reserved ranges (refused at start-up).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

Net = ipaddress.IPv4Network

HOST_SERVICES = "10.0.2.2"  # slirp's gateway, in both runtimes' sandboxes: the host's services, by port
TAP_ADDR = "10.0.2.100"  # what slirp4netns --configure gives its tap (a vm jail's side of it)
SLIRP_NET = Net("10.0.2.0/24")  # the sandbox's own virtual network
NAMED = "named:"
# Ranges no entry may open: "this network", link-local (cloud metadata), multicast, reserved.
NEVER = tuple(Net(c) for c in ("0.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4"))
_LOOPBACK = Net("127.0.0.0/8")
_HOSTNAME_RE = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)(\.(?!-)[a-z0-9-]{1,63}(?<!-))*$")

Resolve = Callable[[str], list[str]]


class AllowlistError(ValueError):
    """An entry the server cannot enforce; the message names it (raised at start-up)."""


@dataclass(frozen=True)
class Entry:
    """One destination: ``net`` (a host service: ``HOST_SERVICES``/32) and ``port`` (None: all)."""

    source: str  # as the operator wrote it
    net: Net
    port: int | None
    named: bool
    host_service: bool = False

    def ports(self) -> list[str]:
        """The match for this entry's port(s): ``-p tcp --dport N`` and udp, or nothing."""
        return [""] if self.port is None else [f" -p {p} --dport {self.port}" for p in ("tcp", "udp")]


@dataclass(frozen=True)
class Allowlist:
    """Every entry, validated, and aenv's own ports, which nothing opens. Empty: today's base filter."""

    entries: tuple[Entry, ...] = ()
    protected: tuple[int, ...] = ()  # aenv's own ports (its API; a cluster's directory and node URLs)

    @property
    def empty(self) -> bool:
        return not self.entries

    @property
    def host_ports(self) -> tuple[int, ...]:
        return tuple(sorted({e.port for e in self.entries if e.host_service and e.port is not None}))

    def covers(self, net: Net) -> bool:
        """Whether a sandbox's ``allowOut`` may name ``net``: it lies inside one entry."""
        return any(net.subnet_of(e.net) for e in self.entries)

    def gateway_rules(self, allow_nets: Sequence[Net], deny_nets: Sequence[Net]) -> list[str]:
        """The filter lines for the host services at ``HOST_SERVICES``, placed first, before loopback is
        accepted: in a vm's jail they arrive DNATed from loopback, and netfilter still matches them as
        leaving through ``lo``. The ports this sandbox may reach, then nothing else there."""
        if not self.host_ports:
            return []
        return [*(f"-A OUTPUT -d {net} -p tcp --dport {e.port} -j ACCEPT"
                  for e in self.entries if e.host_service for net in self._opened(e, allow_nets, deny_nets)),
                f"-A OUTPUT -d {HOST_SERVICES}/32 -j REJECT"]

    def accepts(self, allow_nets: Sequence[Net], deny_nets: Sequence[Net]) -> list[str]:
        """The filter lines (``-A OUTPUT ...``) for a sandbox with these ``allowOut`` (private) and
        ``denyOut`` nets, placed after the host's addresses are rejected and before the private ranges
        are. First what is never opened (aenv's ports, slirp's network), then each entry the sandbox
        may reach: every-sandbox ones it does not deny, and those its ``allowOut`` names (only the
        part it names)."""
        if self.empty:
            return []
        out = [f"-A OUTPUT -d {SLIRP_NET} -j REJECT"]
        for e in self.entries:
            if e.host_service:
                continue
            opened = self._opened(e, allow_nets, deny_nets)
            if e.port is None:
                out += [f"-A OUTPUT -d {net} -p tcp --dport {p} -j REJECT" for net in opened for p in self.protected]
            out += [f"-A OUTPUT -d {net}{match} -j ACCEPT" for net in opened for match in e.ports()]
        return out

    def _opened(self, e: Entry, allow_nets: Sequence[Net], deny_nets: Sequence[Net]) -> list[Net]:
        named = [n for n in allow_nets if n.subnet_of(e.net)]
        if named:
            return named
        if e.named or any(e.net.overlaps(d) for d in deny_nets):
            return []
        return [e.net]

    def describe(self) -> list[dict[str, Any]]:
        """For ``/aenv/info`` and ``aenv doctor``: each entry, what it opens and to whom."""
        return [{"entry": e.source, "reach": f"{HOST_SERVICES}:{e.port}" if e.host_service else _show(e.net, e.port),
                 "hostService": e.host_service, "sandboxes": "named in allowOut" if e.named else "all"}
                for e in self.entries]

    def hint(self) -> str:
        """What a 400 for a private address not allowed tells the client."""
        return ("an operator allows private destinations with the server setting private_egress "
                "(e.g. private_egress = [\"named:10.1.2.3:8000\"], AENV_PRIVATE_EGRESS; host services: "
                f"\"localhost:PORT\", reached at {HOST_SERVICES}:PORT); see docs/security.md, private_egress")


def _show(net: Net, port: int | None) -> str:
    addr = str(net.network_address) if net.prefixlen == 32 else str(net)
    return addr if port is None else f"{addr}:{port}"


def _split(raw: str) -> tuple[str, int | None]:
    """``DEST[:PORT]`` → (DEST, PORT or None)."""
    if raw.count(":") > 1:
        raise AllowlistError(f"private_egress: {raw!r}: aenv sandboxes have no IPv6; entries take IPv4")
    dest, sep, port_s = raw.rpartition(":")
    if not sep:
        return raw, None
    if not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise AllowlistError(f"private_egress: {raw!r}: the port must be a number from 1 to 65535")
    return dest, int(port_s)


def parse(values: Iterable[str], protected: int | Sequence[int], resolve: Resolve) -> Allowlist:
    """Validate the operator's entries (host names resolved by ``resolve``); an error names the entry.
    ``protected``: aenv's own ports, which no host service may be and no whole range opens."""
    guarded = (protected,) if isinstance(protected, int) else tuple(sorted(set(protected)))
    entries: list[Entry] = []
    for value in values:
        raw = value.strip()
        named = raw.startswith(NAMED)
        dest, port = _split(raw[len(NAMED):] if named else raw)
        dest = dest.lower()
        if dest == "localhost" or _is_loopback(dest):
            if port is None:
                raise AllowlistError(f"private_egress: {value!r}: a host service needs its port (localhost:PORT)")
            if port in guarded:
                raise AllowlistError(f"private_egress: {value!r}: that is one of aenv's own ports (its API; a cluster's directory or node URL), never exposed")
            entries.append(Entry(value, Net(f"{HOST_SERVICES}/32"), port, named, host_service=True))
            continue
        for net in _nets(value, dest, resolve):
            if any(net.overlaps(n) for n in (*NEVER, _LOOPBACK)):
                raise AllowlistError(f"private_egress: {value!r}: {net} is loopback, link-local, multicast "
                                     "or reserved; sandboxes never reach those")
            entries.append(Entry(value, net, port, named))
    return Allowlist(tuple(entries), guarded)


def _is_loopback(dest: str) -> bool:
    try:
        return ipaddress.ip_address(dest) in _LOOPBACK
    except ValueError:
        return False


def _nets(value: str, dest: str, resolve: Resolve) -> list[Net]:
    try:
        net = ipaddress.ip_network(dest, strict=False)
    except ValueError:
        return _resolved(value, dest, resolve)
    if not isinstance(net, Net):
        raise AllowlistError(f"private_egress: {value!r}: aenv sandboxes have no IPv6")
    return [net]


def _resolved(value: str, dest: str, resolve: Resolve) -> list[Net]:
    """A host name entry: each of its addresses, as the host resolves it now."""
    if not _HOSTNAME_RE.match(dest):
        raise AllowlistError(f"private_egress: {value!r} is neither an IPv4 address, a CIDR block nor "
                             "a host name, with an optional :PORT")
    addrs = resolve(dest)
    if not addrs:
        raise AllowlistError(f"private_egress: {value!r}: {dest} does not resolve on this host")
    return [Net(f"{a}/32") for a in sorted(set(addrs))]


def resolve_on_host(name: str) -> list[str]:
    """A host name's IPv4 addresses as this host resolves it (what an entry naming it opens)."""
    try:
        infos = socket.getaddrinfo(name, None, family=socket.AF_INET, type=socket.SOCK_STREAM)
    except OSError:
        return []
    return [str(i[4][0]) for i in infos]

"""A sandbox's egress policy (E2B's ``network.allowOut`` / ``denyOut`` / ``dnsServers``) and the
iptables rules that enforce it inside the sandbox's network namespace. Pure: no processes here.

Semantics, as E2B documents them:

* nothing denied ⇒ everything the base filter lets through is allowed; ``allowOut`` alone changes
  nothing (it only carves exceptions out of ``denyOut``);
* an address in ``allowOut`` is allowed even when ``denyOut`` covers it (allow wins);
* ``allowOut`` may name domains (``api.example.com``, ``*.example.com``: subdomains at any depth, not
  the apex); ``denyOut`` takes IPs and CIDRs only. Domains are matched by the host name each
  connection carries (TLS SNI, HTTP Host) in the egress proxy (``runtime/egress.py``): TCP to a denied
  address is redirected there, and it lets through what names an allowed domain;
* when ``allowOut`` names a domain, the DNS servers in ``dnsServers`` are allowed (all traffic), or,
  without the field, the sandbox's own resolver is, so allowed names still resolve.

Underneath, always: the base filter of ``network.py`` (no host address, no private or special range).
An allow rule never opens those, except what the operator's allowlist (``allowlist.py``) lets a
sandbox name; :func:`parse` refuses one that could only name anything else, saying how an operator
allows it.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aenv.errors import InvalidRequest
from aenv.runtime import egress_rules
from aenv.runtime.allowlist import HOST_SERVICES, TAP_ADDR, Allowlist
from aenv.runtime.egress_rules import HeaderRule

ALL_TRAFFIC = "0.0.0.0/0"
NESTED_NET = "10.0.3.0/30"  # a nested sandbox's link to its router (agent/nested.py: ROUTER_ADDR, NESTED_ADDR)
MAX_ENTRIES = 256  # per list: every entry is an iptables rule on a sandbox's path out
MAX_DNS_SERVERS = 10  # as E2B
_LABEL = r"(?!-)[a-z0-9-]{1,63}(?<!-)"
_DOMAIN_RE = re.compile(rf"^(\*\.)?{_LABEL}(\.{_LABEL})+$")

Net = ipaddress.IPv4Network


@dataclass(frozen=True)
class EgressPolicy:
    """One sandbox's rules, validated. The empty policy changes nothing."""

    allow_nets: tuple[Net, ...] = ()
    allow_domains: tuple[str, ...] = ()  # lowercase, without a trailing dot; "*.x" = below x
    deny_nets: tuple[Net, ...] = ()
    dns_servers: tuple[str, ...] | None = None  # None: the field was not given (the resolver is allowed)
    private_nets: tuple[Net, ...] = ()  # allowOut's private entries, each inside the operator's allowlist
    rules: tuple[HeaderRule, ...] = ()  # network.rules: header transforms (runtime/egress_rules.py)
    # The wire form it was parsed from (allowOut/denyOut as sent, normalised), for the detail and the store.
    record: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def empty(self) -> bool:
        return not self.deny_nets and not self.private_nets and not self.rules

    @property
    def needs_proxy(self) -> bool:
        """Connections go to the egress proxy: to denied addresses where it can let a domain through,
        and to the ports of the header rules."""
        return self.proxies_denied or bool(self.rules)

    @property
    def proxies_denied(self) -> bool:
        """Connections to denied addresses go to the egress proxy, which can let a domain through."""
        return bool(self.allow_domains and self.deny_nets)

    def allowed_nets(self) -> tuple[Net, ...]:
        """Addresses allowed in spite of ``denyOut``: ``allowOut``'s, and the DNS servers when a domain is."""
        extra = tuple(Net(f"{a}/32") for a in self.dns_servers or ()) if self.allow_domains else ()
        return self.allow_nets + extra

    def ip_allowed(self, addr: str) -> bool:
        """Whether the IP rules alone let a connection to ``addr`` out (allow wins over deny)."""
        ip = ipaddress.ip_address(addr)
        if any(ip in n for n in self.allowed_nets()):
            return True
        return not any(ip in n for n in self.deny_nets)

    def resolver_allowed(self, resolver: str) -> bool:
        """The sandbox's own resolver is E2B's default DNS server: allowed unless denied, and allowed
        for a domain rule unless ``dnsServers`` replaced it."""
        return self.ip_allowed(resolver) or (bool(self.allow_domains) and self.dns_servers is None)

    def allows_domain(self, name: str) -> bool:
        name = name.lower().rstrip(".")
        return any(domain_matches(d, name) for d in self.allow_domains)

    def with_deny_all(self) -> EgressPolicy:
        """The policy of ``allow_internet_access: false`` with these rules (E2B: the same as denying
        ``0.0.0.0/0``; what ``allowOut`` names stays reachable)."""
        if Net(ALL_TRAFFIC) in self.deny_nets:
            return self
        return EgressPolicy(self.allow_nets, self.allow_domains, (*self.deny_nets, Net(ALL_TRAFFIC)),
                            self.dns_servers, self.private_nets, self.rules, self.record)


def domain_matches(pattern: str, name: str) -> bool:
    if pattern.startswith("*."):
        return name.endswith(pattern[1:]) and len(name) > len(pattern) - 1
    return name == pattern


def _blocked(net: Net, blocked: Sequence[Net]) -> bool:
    """True when every address of ``net`` is in a range the base filter always rejects."""
    return any(net.subnet_of(b) for b in blocked)


def _net(value: str, where: str) -> Net | None:
    """``value`` as an IPv4 network (a bare IP is a /32), None if it is not an address at all."""
    try:
        net = ipaddress.ip_network(value, strict=False)
    except ValueError:
        return None
    if net.version != 4:
        raise InvalidRequest(f"{where}: {value!r}: aenv sandboxes have no IPv6; rules take IPv4 addresses")
    assert isinstance(net, Net)
    return net


def _strings(value: Any, where: str, limit: int) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidRequest(f"{where}: a list of strings")
    if len(value) > limit:
        raise InvalidRequest(f"{where}: at most {limit} entries")
    return [v.strip() for v in value]


def parse(allow_out: Any, deny_out: Any, dns_servers: Any, blocked: Iterable[str], prefix: str = "network.",
          private: Allowlist | None = None, lenient: bool = False, rules: Any = None,
          bind: Callable[[str], str] | None = None, bound: dict[str, str] | None = None) -> EgressPolicy:
    """Validate E2B's lists. Anything aenv could not enforce is a 400 naming it: IPv6, a domain in
    ``denyOut``, or an allow entry that only names ranges sandboxes never reach (``blocked``) and
    the operator's allowlist (``private``) does not cover. ``lenient``: such an entry is left out
    instead (a stored record, from before the operator narrowed the allowlist). ``rules``, ``bind``,
    ``bound``: E2B's header rules and their secrets (``egress_rules.parse``)."""
    blocked_nets = [Net(b) for b in blocked]
    private = private or Allowlist()
    allow_nets: list[Net] = []
    private_nets: list[Net] = []
    domains: list[str] = []
    for entry in _strings(allow_out, f"{prefix}allowOut", MAX_ENTRIES):
        net = _net(entry, f"{prefix}allowOut")
        if net is None:
            name = entry.lower().rstrip(".")
            if not _DOMAIN_RE.match(name):
                raise InvalidRequest(f"{prefix}allowOut: {entry!r} is neither an IPv4 address, a CIDR block "
                                     "nor a domain name (example.com, *.example.com)")
            domains.append(name)
        elif _blocked(net, blocked_nets):
            if private.covers(net):
                private_nets.append(net)
            elif not lenient:
                raise InvalidRequest(f"{prefix}allowOut: {entry!r} is a private or special range that this "
                                     "server's operator has not allowed; aenv sandboxes reach only the private "
                                     f"destinations an operator allows, and never the host: {private.hint()}")
        else:
            allow_nets.append(net)
    deny_nets: list[Net] = []
    for entry in _strings(deny_out, f"{prefix}denyOut", MAX_ENTRIES):
        net = _net(entry, f"{prefix}denyOut")
        if net is None:
            raise InvalidRequest(f"{prefix}denyOut: {entry!r}: deny rules take IPv4 addresses and CIDR "
                                 "blocks only (domains are not supported for deny rules, as on E2B)")
        deny_nets.append(net)
    servers: tuple[str, ...] | None = None
    if dns_servers is not None:
        found = []
        for entry in _strings(dns_servers, f"{prefix}dnsServers", MAX_DNS_SERVERS):
            net = _net(entry, f"{prefix}dnsServers")
            if net is None or net.prefixlen != 32 or "/" in entry:
                raise InvalidRequest(f"{prefix}dnsServers: {entry!r} is not an IPv4 address")
            if _blocked(net, blocked_nets):
                raise InvalidRequest(f"{prefix}dnsServers: {entry!r} is a private or special address; "
                                     "aenv sandboxes never reach those")
            found.append(str(net.network_address))
        servers = tuple(found)
    header_rules, secret_ids = egress_rules.parse(rules, prefix, bind, bound)
    record: dict[str, Any] = {"allowOut": [*map(_show, allow_nets), *map(_show, private_nets), *domains],
                              "denyOut": [*map(_show, deny_nets)]}
    if servers is not None:
        record["dnsServers"] = list(servers)
    if header_rules:
        record["rules"] = rules
        record["secretIDs"] = secret_ids
    return EgressPolicy(tuple(allow_nets), tuple(domains), tuple(deny_nets), servers, tuple(private_nets),
                        header_rules, record)


def _show(net: Net) -> str:
    return str(net.network_address) if net.prefixlen == 32 else str(net)


def from_record(record: dict[str, Any] | None, blocked: Iterable[str], private: Allowlist | None = None) -> EgressPolicy:
    """The policy a stored record describes (the record came out of :func:`parse`); a private entry
    the allowlist no longer covers is left out (closed)."""
    r = record or {}
    return parse(r.get("allowOut"), r.get("denyOut"), r.get("dnsServers"), blocked, private=private, lenient=True,
                 rules=r.get("rules"), bound=r.get("secretIDs") or {})


def render(host_addrs: Iterable[str], blocked: Sequence[str], resolver: str, slirp_dns: str,
           policy: EgressPolicy | None = None, proxy_port: int | None = None,
           private: Allowlist | None = None, jail: bool = False, own_ports: Sequence[int] = ()) -> str:
    """``iptables-restore`` input for a sandbox's namespace: both tables, replaced atomically.

    filter/OUTPUT: the host services the operator exposes (``private``; first: a vm jail's come DNATed
    from loopback); loopback; DNS to the resolver (accepted or rejected per the policy); the host's
    addresses rejected; what the operator's allowlist opens to this sandbox (``private``); ``blocked``
    rejected; then the policy: allowed nets accepted before denied ones are rejected (allow wins); the
    rest accepted. nat/OUTPUT: queries to slirp's resolver go to ``resolver`` when that is another
    server; in a vm's QEMU jail (``jail``), the guest's host services (QEMU dials them on the jail's
    127.0.0.1) go to slirp4netns's gateway, the host's loopback; with a proxy, TCP to denied nets is
    redirected to it (allowed and always-blocked addresses are left alone: the filter decides those
    at once); ``own_ports``: TCP to loopback and the host's addresses on these ports goes to the proxy
    too, first (a header rule for one of this server's sandbox hosts: ``egress_own.py``)."""
    policy = policy or EgressPolicy()
    private = private or Allowlist()
    hosts = sorted({a for a in host_addrs if ipaddress.ip_address(a).version == 4})
    nat = ["*nat", ":PREROUTING ACCEPT [0:0]", ":INPUT ACCEPT [0:0]", ":OUTPUT ACCEPT [0:0]",
           ":POSTROUTING ACCEPT [0:0]"]  # fmt: skip
    if resolver != slirp_dns:
        for proto in ("udp", "tcp"):
            nat.append(f"-A OUTPUT -d {slirp_dns}/32 -p {proto} --dport 53 -j DNAT --to-destination {resolver}:53")
    if jail:
        for port in private.host_ports:
            nat.append(f"-A OUTPUT -o lo -d 127.0.0.1/32 -p tcp --dport {port} -j DNAT "
                       f"--to-destination {HOST_SERVICES}:{port}")
        if private.host_ports:
            nat.append(f"-A POSTROUTING -s 127.0.0.0/8 -d {HOST_SERVICES}/32 -j SNAT --to-source {TAP_ADDR}")
    if proxy_port is not None and policy.needs_proxy:
        for port in own_ports:
            for dst in ("127.0.0.0/8", *(f"{a}/32" for a in hosts)):
                nat.append(f"-A OUTPUT -p tcp -d {dst} --dport {port} -j REDIRECT --to-ports {proxy_port}")
        nat.append("-A OUTPUT -o lo -j RETURN")
        for net in (*(Net(f"{a}/32") for a in hosts), *map(Net, blocked)):
            nat.append(f"-A OUTPUT -p tcp -d {net} -j RETURN")
        for port in egress_rules.ports(policy.rules):  # header rules: the proxy sees these ports, allowed or not
            nat.append(f"-A OUTPUT -p tcp --dport {port} -j REDIRECT --to-ports {proxy_port}")
        if policy.proxies_denied:
            for net in policy.allowed_nets():
                nat.append(f"-A OUTPUT -p tcp -d {net} -j RETURN")
            for net in policy.deny_nets:
                nat.append(f"-A OUTPUT -p tcp -d {net} -j REDIRECT --to-ports {proxy_port}")
    # A nested sandbox's router (``nested.behind_router``) sends its sandbox's traffic out as its own.
    nat.append(f"-A POSTROUTING -s {NESTED_NET} -o tap0 -j MASQUERADE")
    nat.append("COMMIT")
    dns = "ACCEPT" if policy.resolver_allowed(resolver) else "REJECT"
    flt = ["*filter", ":INPUT ACCEPT [0:0]", ":FORWARD DROP [0:0]", ":OUTPUT ACCEPT [0:0]",
           *private.gateway_rules(policy.private_nets, policy.deny_nets), "-A OUTPUT -o lo -j ACCEPT",
           # only what leaves through slirp4netns's tap is filtered: a sandbox that runs Docker inside
           # reaches its own containers' bridges (no other sandbox has an interface besides these two)
           "-A OUTPUT ! -o tap0 -j ACCEPT"]  # fmt: skip
    if proxy_port is not None and policy.needs_proxy:  # redirected to the proxy (still routed out here)
        flt.append("-A OUTPUT -d 127.0.0.1/32 -m conntrack --ctstate DNAT -j ACCEPT")
    for proto in ("udp", "tcp"):
        flt.append(f"-A OUTPUT -d {resolver}/32 -p {proto} --dport 53 -j {dns}")
    flt += [f"-A OUTPUT -d {a}/32 -j REJECT" for a in hosts]
    flt += private.accepts(policy.private_nets, policy.deny_nets)
    flt += [f"-A OUTPUT -d {cidr} -j REJECT" for cidr in blocked]
    flt += [f"-A OUTPUT -d {net} -j ACCEPT" for net in policy.allowed_nets()]
    flt += [f"-A OUTPUT -d {net} -j REJECT" for net in policy.deny_nets]
    # What a sandbox forwards (only one that runs Docker inside has anything to forward: its containers'
    # traffic) meets the same rules on its way out; the rest of it stays between its own bridges.
    rules = [line for line in flt if line.startswith("-A OUTPUT ")]
    flt += [line.replace("-A OUTPUT ", "-A FORWARD ", 1) for line in rules] + ["-A FORWARD -j ACCEPT"]
    flt.append("COMMIT")
    return "\n".join(nat + flt) + "\n"

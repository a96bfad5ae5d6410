"""The egress policy (E2B's allowOut / denyOut / dnsServers), its rules, and what the egress proxy
reads off a connection's first bytes."""

from __future__ import annotations

import ssl
import struct

import pytest

from aenv.errors import InvalidRequest
from aenv.runtime.netpolicy import EgressPolicy, domain_matches, parse, render
from aenv.runtime.network import BLOCKED_RANGES, SLIRP_DNS
from aenv.runtime.sniff import NeedMore, a_answers, a_query, host_name


def _p(allow: list[str] | None = None, deny: list[str] | None = None, dns: list[str] | None = None) -> EgressPolicy:
    return parse(allow, deny, dns, BLOCKED_RANGES)


def test_allow_wins_over_deny_and_nothing_denied_is_no_policy() -> None:
    assert _p(["1.1.1.1"]).empty and _p(["1.1.1.1"]).ip_allowed("8.8.8.8")
    p = _p(["1.1.1.1", "8.8.4.0/24"], ["0.0.0.0/0"])
    assert p.ip_allowed("1.1.1.1") and p.ip_allowed("8.8.4.4")
    assert not p.ip_allowed("8.8.8.8") and not p.ip_allowed("198.51.100.2")
    only = _p(None, ["8.8.8.8"])
    assert not only.ip_allowed("8.8.8.8") and only.ip_allowed("1.1.1.1")
    assert p.record == {"allowOut": ["1.1.1.1", "8.8.4.0/24"], "denyOut": ["0.0.0.0/0"]}


def test_domains_and_wildcards() -> None:
    p = _p(["Example.COM.", "*.wild.test"], ["0.0.0.0/0"])
    assert p.needs_proxy and p.allow_domains == ("example.com", "*.wild.test")
    assert p.allows_domain("example.com") and not p.allows_domain("www.example.com")
    assert p.allows_domain("a.wild.test") and p.allows_domain("a.b.wild.test") and not p.allows_domain("wild.test")
    assert not p.allows_domain("evilwild.test")
    assert domain_matches("*.x.test", "y.x.test") and not domain_matches("*.x.test", "x.test")
    assert not _p(["example.com"]).needs_proxy  # nothing denied: nothing to check


def test_dns_servers_and_the_resolver() -> None:
    deny_all = _p(None, ["0.0.0.0/0"])
    assert not deny_all.resolver_allowed(SLIRP_DNS)  # deny all: no DNS either
    assert _p(["example.com"], ["0.0.0.0/0"]).resolver_allowed(SLIRP_DNS)  # a domain needs names
    custom = _p(["example.com"], ["0.0.0.0/0"], ["1.1.1.1"])
    assert not custom.resolver_allowed(SLIRP_DNS) and custom.ip_allowed("1.1.1.1")
    assert not _p(None, ["0.0.0.0/0"], ["1.1.1.1"]).ip_allowed("1.1.1.1")  # only with a domain
    assert _p(None, ["8.8.8.8"]).resolver_allowed(SLIRP_DNS)


@pytest.mark.parametrize(("allow", "deny", "dns", "named"), [
    (["10.0.0.0/8"], None, None, "allowOut"),
    (["127.0.0.1"], None, None, "allowOut"),
    (["2001:db8::/32"], None, None, "IPv6"),
    (["not a host"], None, None, "allowOut"),
    (None, ["example.com"], None, "denyOut"),
    (None, None, ["1.1.1.0/24"], "dnsServers"),
    (None, None, ["192.168.0.1"], "dnsServers"),
    (["1.1.1.1"] * 300, None, None, "at most"),
    ("1.1.1.1", None, None, "list of strings"),
])  # fmt: skip
def test_what_cannot_be_enforced_is_refused_by_name(allow: object, deny: object, dns: object, named: str) -> None:
    with pytest.raises(InvalidRequest, match=named):
        parse(allow, deny, dns, BLOCKED_RANGES)


def test_render_orders_allow_before_deny_after_the_base_filter() -> None:
    p = _p(["1.1.1.1", "example.com"], ["0.0.0.0/0"])
    text = render(["203.0.113.9"], BLOCKED_RANGES, SLIRP_DNS, SLIRP_DNS, p, proxy_port=4242)
    nat, flt = text.split("*filter\n")
    rules = flt.splitlines()
    base = rules.index("-A OUTPUT -d 10.0.0.0/8 -j REJECT")
    allow = rules.index("-A OUTPUT -d 1.1.1.1/32 -j ACCEPT")
    deny = rules.index("-A OUTPUT -d 0.0.0.0/0 -j REJECT")
    assert rules.index("-A OUTPUT -d 203.0.113.9/32 -j REJECT") < base < allow < deny
    assert f"-A OUTPUT -d {SLIRP_DNS}/32 -p udp --dport 53 -j ACCEPT" in rules  # the domain needs DNS
    nat_rules = nat.splitlines()
    redirect = nat_rules.index("-A OUTPUT -p tcp -d 0.0.0.0/0 -j REDIRECT --to-ports 4242")
    assert nat_rules.index("-A OUTPUT -p tcp -d 1.1.1.1/32 -j RETURN") < redirect
    assert nat_rules.index("-A OUTPUT -p tcp -d 203.0.113.9/32 -j RETURN") < redirect  # rejected at once
    deny_all = render([], BLOCKED_RANGES, "198.51.100.53", SLIRP_DNS, _p(None, ["0.0.0.0/0"]))
    assert "REDIRECT" not in deny_all and "-A OUTPUT -d 198.51.100.53/32 -p udp --dport 53 -j REJECT" in deny_all
    assert f"-d {SLIRP_DNS}/32 -p udp --dport 53 -j DNAT --to-destination 198.51.100.53:53" in deny_all


def _client_hello(name: str) -> bytes:
    """A real ClientHello, from Python's own TLS stack."""
    ctx = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=name)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def test_host_name_from_sni_and_http() -> None:
    hello = _client_hello("api.example.com")
    assert host_name(hello) == "api.example.com"
    with pytest.raises(NeedMore):
        host_name(hello[:40])
    assert host_name(b"GET / HTTP/1.1\r\nHost: Allowed.Test:8080\r\nAccept: */*\r\n\r\n") == "allowed.test"
    assert host_name(b"GET / HTTP/1.0\r\n\r\n") is None
    with pytest.raises(NeedMore):
        host_name(b"GET / HTTP/1.1\r\nHo")
    assert host_name(b"SSH-2.0-OpenSSH_9.6\r\n") is None
    assert host_name(b"GET / HTTP/1.1\r\nHost: [::1]:80\r\n\r\n") is None


def test_dns_query_and_answer() -> None:
    qid, query = a_query("allowed.test")
    assert query[12:] == b"\x07allowed\x04test\x00\x00\x01\x00\x01"
    answer = (struct.pack("!HHHHHH", qid, 0x8180, 1, 1, 0, 0) + query[12:]
              + b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 60, 4) + bytes([198, 51, 100, 2]))
    assert a_answers(qid, answer) == ["198.51.100.2"]
    assert a_answers(qid ^ 1, answer) == []  # not ours
    assert a_answers(qid, answer[:5]) == []

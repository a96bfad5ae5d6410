"""The operator's allowlist of private destinations: parsing, what a sandbox's allowOut may name, and
the filter lines it adds (the base filter without one is unchanged)."""

from __future__ import annotations

import pytest

from aenv.errors import InvalidRequest
from aenv.runtime.allowlist import HOST_SERVICES, AllowlistError, parse
from aenv.runtime.netpolicy import parse as parse_policy
from aenv.runtime.netpolicy import render
from aenv.runtime.network import BLOCKED_RANGES, SLIRP_DNS

NAMES = {"model.internal": ["10.9.8.7", "10.9.8.6"]}


def _resolve(name: str) -> list[str]:
    return NAMES.get(name, [])


def _rules(entries: list[str], allow: list[str] | None = None, deny: list[str] | None = None,
           jail: bool = False) -> list[str]:
    private = parse(entries, 8000, _resolve)
    policy = parse_policy(allow, deny, None, BLOCKED_RANGES, private=private)
    return render(["192.0.2.2"], BLOCKED_RANGES, SLIRP_DNS, SLIRP_DNS, policy, None, private, jail).splitlines()


def _filter(lines: list[str]) -> list[str]:
    """The filter table's OUTPUT part (FORWARD repeats its rules: ``test_forwarded_traffic_meets_the_same_rules``)."""
    return [line for line in lines[lines.index("*filter"):] if not line.startswith("-A FORWARD ")]


def test_forwarded_traffic_meets_the_same_rules() -> None:
    """A sandbox running Docker inside forwards its containers' traffic: the same rules, in order, then
    the rest accepted as OUTPUT's policy does; only what goes out through the tap is filtered."""
    lines = _rules(["localhost:9000", "10.1.2.0/24"], deny=["0.0.0.0/0"])
    out = [line.removeprefix("-A OUTPUT ") for line in lines if line.startswith("-A OUTPUT ")
           and lines.index(line) > lines.index("*filter")]
    fwd = [line.removeprefix("-A FORWARD ") for line in lines if line.startswith("-A FORWARD ")]
    assert fwd == [*out, "-j ACCEPT"]
    assert "! -o tap0 -j ACCEPT" in fwd and fwd.index("! -o tap0 -j ACCEPT") < fwd.index("-d 10.0.0.0/8 -j REJECT")


def test_entries_parse_with_ports_scopes_names_and_host_services() -> None:
    a = parse(["10.1.2.0/24", "named:10.3.0.5:8443", "model.internal:8000", "localhost:9000",
               "named:127.0.0.1:9001"], 8080, _resolve)
    shown = [(d["reach"], d["sandboxes"], d["hostService"]) for d in a.describe()]
    assert shown == [("10.1.2.0/24", "all", False), ("10.3.0.5:8443", "named in allowOut", False),
                     ("10.9.8.6:8000", "all", False), ("10.9.8.7:8000", "all", False),
                     (f"{HOST_SERVICES}:9000", "all", True), (f"{HOST_SERVICES}:9001", "named in allowOut", True)]
    assert a.host_ports == (9000, 9001)
    assert parse([], 8000, _resolve).empty


@pytest.mark.parametrize(("entry", "says"), [
    ("localhost", "needs its port"),
    ("localhost:8000", "aenv's own ports"),
    ("169.254.169.254", "link-local"),
    ("10.0.0.0/8:0", "port must be"),
    ("10.0.0.1:http", "port must be"),
    ("nowhere.internal", "does not resolve"),
    ("bad name!", "neither"),
    ("fd00::/8", "IPv6"),
    ("0.0.0.0/0", "reserved"),
])
def test_entries_the_server_refuses_to_start_with(entry: str, says: str) -> None:
    with pytest.raises(AllowlistError, match=says):
        parse([entry], 8000, _resolve)


def test_default_filter_is_unchanged_by_an_empty_allowlist() -> None:
    assert render(["192.0.2.2"], BLOCKED_RANGES, SLIRP_DNS, SLIRP_DNS) == "\n".join(_rules([])) + "\n"
    accepted = [line for line in _filter(_rules([])) if line.endswith("-j ACCEPT")]
    assert accepted == ["-A OUTPUT -o lo -j ACCEPT", "-A OUTPUT ! -o tap0 -j ACCEPT",
                        *(f"-A OUTPUT -d {SLIRP_DNS}/32 -p {p} --dport 53 -j ACCEPT" for p in ("udp", "tcp"))]


def test_every_sandbox_entry_is_accepted_before_the_private_ranges_are_rejected() -> None:
    flt = _filter(_rules(["10.1.2.3:8080"]))
    accept_tcp = "-A OUTPUT -d 10.1.2.3/32 -p tcp --dport 8080 -j ACCEPT"
    assert accept_tcp in flt and "-A OUTPUT -d 10.1.2.3/32 -p udp --dport 8080 -j ACCEPT" in flt
    assert flt.index("-A OUTPUT -d 192.0.2.2/32 -j REJECT") < flt.index(accept_tcp)  # the host first
    assert flt.index(accept_tcp) < flt.index("-A OUTPUT -d 10.0.0.0/8 -j REJECT")
    assert not any("10.1.2.3/32 -j ACCEPT" in line for line in flt)  # that port alone


def test_a_whole_range_never_opens_the_api_port_nor_the_sandboxes_own_network() -> None:
    flt = _filter(_rules(["10.1.0.0/16"]))
    reject_api = "-A OUTPUT -d 10.1.0.0/16 -p tcp --dport 8000 -j REJECT"
    assert flt.index(reject_api) < flt.index("-A OUTPUT -d 10.1.0.0/16 -j ACCEPT")
    assert flt.index("-A OUTPUT -d 10.0.2.0/24 -j REJECT") < flt.index("-A OUTPUT -d 10.1.0.0/16 -j ACCEPT")


def test_named_entries_open_only_for_a_sandbox_that_names_them_and_only_what_it_names() -> None:
    entries = ["named:10.1.2.0/24:8080"]
    assert not any("10.1.2" in line and "ACCEPT" in line for line in _rules(entries))
    named = _filter(_rules(entries, allow=["10.1.2.7"], deny=["0.0.0.0/0"]))
    assert "-A OUTPUT -d 10.1.2.7/32 -p tcp --dport 8080 -j ACCEPT" in named
    assert not any("10.1.2.0/24" in line and "ACCEPT" in line for line in named)
    with pytest.raises(InvalidRequest, match="private_egress") as err:
        parse_policy(["10.1.3.1"], None, None, BLOCKED_RANGES, private=parse(entries, 8000, _resolve))
    assert "not allowed" in str(err.value)


def test_a_sandbox_that_denies_an_every_sandbox_entry_must_name_it() -> None:
    accept = "-A OUTPUT -d 10.1.2.3/32 -p tcp --dport 8080 -j ACCEPT"
    assert accept not in _rules(["10.1.2.3:8080"], deny=["0.0.0.0/0"])
    assert accept in _rules(["10.1.2.3:8080"], allow=["10.1.2.3"], deny=["0.0.0.0/0"])


def test_host_services_at_the_gateway_port_by_port_and_the_rest_of_it_rejected() -> None:
    flt = _filter(_rules(["localhost:9000"]))
    accept = f"-A OUTPUT -d {HOST_SERVICES}/32 -p tcp --dport 9000 -j ACCEPT"
    # before loopback is accepted: a vm jail's arrive DNATed from lo, and still match "-o lo"
    assert flt.index(accept) < flt.index(f"-A OUTPUT -d {HOST_SERVICES}/32 -j REJECT") < flt.index(
        "-A OUTPUT -o lo -j ACCEPT")
    assert sum(HOST_SERVICES in line and "ACCEPT" in line for line in flt) == 1
    denied = _filter(_rules(["localhost:9000"], deny=["0.0.0.0/0"], jail=True))
    assert accept not in denied and denied.index(f"-A OUTPUT -d {HOST_SERVICES}/32 -j REJECT") < denied.index(
        "-A OUTPUT -o lo -j ACCEPT")
    assert not any("DNAT" in line and "9000" in line for line in _rules(["localhost:9000"]))  # ns: no forward
    jail = _rules(["localhost:9000"], jail=True)
    assert f"-A OUTPUT -o lo -d 127.0.0.1/32 -p tcp --dport 9000 -j DNAT --to-destination {HOST_SERVICES}:9000" in jail
    assert any(line.startswith("-A POSTROUTING -s 127.0.0.0/8") and "SNAT" in line for line in jail)


def test_stored_records_drop_what_the_allowlist_no_longer_covers() -> None:
    from aenv.runtime.netpolicy import from_record

    record = {"allowOut": ["10.1.2.3", "1.1.1.1"], "denyOut": ["0.0.0.0/0"]}
    kept = from_record(record, BLOCKED_RANGES, parse(["10.1.2.0/24"], 8000, _resolve))
    assert [str(n) for n in kept.private_nets] == ["10.1.2.3/32"]
    dropped = from_record(record, BLOCKED_RANGES, parse([], 8000, _resolve))
    assert dropped.private_nets == () and [str(n) for n in dropped.allow_nets] == ["1.1.1.1/32"]


def test_aenvs_own_ports_in_a_cluster_are_protected_too() -> None:
    from aenv.config import Settings

    s = Settings(port=8000, cluster_redis="redis://10.1.0.1:6380", cluster_url="http://10.1.0.2:8001")
    assert s.service_ports == (6380, 8000, 8001)
    a = parse(["10.1.0.0/16"], s.service_ports, _resolve)
    flt = _filter(render([], BLOCKED_RANGES, SLIRP_DNS, SLIRP_DNS, None, None, a).splitlines())
    for port in (6380, 8000, 8001):
        assert flt.index(f"-A OUTPUT -d 10.1.0.0/16 -p tcp --dport {port} -j REJECT") < flt.index(
            "-A OUTPUT -d 10.1.0.0/16 -j ACCEPT")
    with pytest.raises(AllowlistError, match="aenv's own ports"):
        parse(["localhost:6380"], s.service_ports, _resolve)


def test_host_names_resolve_on_the_host() -> None:
    from aenv.runtime.allowlist import resolve_on_host

    assert "127.0.0.1" in resolve_on_host("localhost")
    assert resolve_on_host("no-such-name.invalid") == []


def test_the_nested_link_is_masqueraded_out_of_the_tap() -> None:
    """The launcher's router addresses (stdlib-only, so its own constants) lie in the net the filter
    masquerades."""
    import ipaddress

    from aenv.agent import nested
    from aenv.runtime.netpolicy import NESTED_NET

    net = ipaddress.ip_network(NESTED_NET)
    assert net.prefixlen == nested.NESTED_PREFIX
    assert {ipaddress.ip_address(nested.ROUTER_ADDR), ipaddress.ip_address(nested.NESTED_ADDR)} <= set(net.hosts())
    assert f"-A POSTROUTING -s {NESTED_NET} -o tap0 -j MASQUERADE" in _rules([])

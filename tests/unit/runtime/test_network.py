from __future__ import annotations

from aenv.runtime.network import SLIRP_DNS, firewall_rules


def test_firewall_allows_dns_before_rejecting_private_ranges_and_host() -> None:
    text = firewall_rules(["192.0.2.2", "127.0.0.1", "203.0.113.9"])
    assert text.startswith("*nat\n") and "\n-A OUTPUT -j" not in text.split("*filter")[0]  # no policy: no NAT
    rules = text.split("*filter\n")[1].splitlines()
    assert rules[-1] == "COMMIT"
    dns = rules.index(f"-A OUTPUT -d {SLIRP_DNS}/32 -p udp --dport 53 -j ACCEPT")
    first_reject = next(i for i, r in enumerate(rules) if r.endswith("REJECT"))
    assert dns < first_reject
    assert "-A OUTPUT -d 203.0.113.9/32 -j REJECT" in rules  # a public host address too
    for cidr in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16", "127.0.0.0/8"):
        assert f"-A OUTPUT -d {cidr} -j REJECT" in rules
    assert "-A OUTPUT -o lo -j ACCEPT" in rules

from __future__ import annotations

import os

import pytest

from aenv.runtime import network
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


def _fresh_backend(monkeypatch: pytest.MonkeyPatch, legacy_found: bool, probe_code: int) -> list[list[str]]:
    calls: list[list[str]] = []

    def restore(argv: list[str], rules: str, pid: int | None = None) -> tuple[int, str]:
        calls.append(argv)
        assert "REDIRECT" in rules and "DNAT" in rules and "conntrack" in rules and "REJECT" in rules
        return probe_code, ""

    monkeypatch.setattr(network, "_restore_tool", None)
    monkeypatch.setattr(network, "_restore", restore)
    monkeypatch.setattr(network.shutil, "which", lambda name: None if name == network.LEGACY_RESTORE and not legacy_found
                        else f"/usr/sbin/{name}")
    return calls


@pytest.mark.parametrize(("found", "code", "chosen"), [(True, 0, network.LEGACY_RESTORE), (True, 1, network.NFT_RESTORE),
                                                     (False, 0, network.NFT_RESTORE)])
async def test_backend_is_legacy_only_where_it_takes_every_rule(monkeypatch: pytest.MonkeyPatch, found: bool, code: int,
                                                                chosen: str) -> None:
    calls = _fresh_backend(monkeypatch, found, code)
    assert await network.restore_tool() == chosen
    assert await network.restore_tool() == chosen  # chosen once: every namespace gets the same backend
    assert calls == ([["unshare", "--net", network.LEGACY_RESTORE]] if found else [])


class _DeadRestorer:
    tool = network.LEGACY_RESTORE

    def run(self, rules: str) -> tuple[int, str]:
        return -9, ""  # killed while it waited


async def test_a_dead_restorer_falls_back_to_a_fresh_restore(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[list[str], int | None]] = []

    def restore(argv: list[str], rules: str, pid: int | None = None) -> tuple[int, str]:
        calls.append((argv, pid))
        return 0, ""

    monkeypatch.setattr(network, "_restore_tool", network.LEGACY_RESTORE)
    monkeypatch.setattr(network, "_restore", restore)
    await network.install_firewall(4242, ["192.0.2.2"], restorer=_DeadRestorer())  # type: ignore[arg-type]
    assert calls == [([network.LEGACY_RESTORE], 4242)]
    monkeypatch.setattr(network, "_restore", lambda argv, rules, pid=None: (1, "no such table"))
    with pytest.raises(network.NetworkError, match="no such table"):
        await network.install_firewall(4242, ["192.0.2.2"])


@pytest.mark.skipif(os.geteuid() != 0 or not network.slirp_available(), reason="needs root and slirp4netns")
async def test_a_slirp_whose_sandbox_ended_is_closed_and_one_serving_a_live_one_is_not() -> None:
    """slirp4netns does not exit with the namespace it serves: the sweep closes the ones this process
    started whose target ended, and only those."""
    import asyncio
    import subprocess

    targets = [subprocess.Popen(["unshare", "--net", "sleep", "60"]) for _ in range(2)]  # noqa: ASYNC220 - instant
    slirps: list[network.Slirp] = []
    try:
        await asyncio.sleep(0.2)  # both in their own namespace
        slirps = [await network.Slirp.start(t.pid) for t in targets]
        ended, live = slirps
        targets[0].kill()
        targets[0].wait()
        closed = await network.close_orphaned_slirps()  # (and any an earlier test of this process left)
        assert ended.ref.pid in closed and live.ref.pid not in closed
        assert not ended.ref.alive() and live.ref.alive()
        assert ended.ref.pid not in await network.close_orphaned_slirps()  # closed once
    finally:
        for t in targets:
            t.kill()
            t.wait()
        for slirp in slirps:
            await slirp.aclose()

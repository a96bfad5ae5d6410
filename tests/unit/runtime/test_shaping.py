"""runtime/shaping.py: the tc lines a sandbox's limits become, the registry by key, and (as root,
where tc works) the limits really written into a throwaway network namespace before a tap is used."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator

import pytest

from aenv.errors import InvalidRequest
from aenv.runtime import shaping
from aenv.runtime.shaping import IFB, MIN_BURST, SHAPER, TAP, Bandwidth, Shaper, render


def test_zero_and_none_are_unlimited() -> None:
    assert shaping.of(0, None).unlimited and shaping.of(None, 0) == shaping.UNLIMITED
    assert shaping.of(5, 0) == Bandwidth(5, None) and not Bandwidth(5, None).unlimited


def test_a_fresh_tap_gets_egress_on_its_root_and_ingress_through_the_ifb() -> None:
    clear, write = render(Bandwidth(10, 20), fresh=True)
    assert clear == []
    assert write[0] == f"qdisc replace dev {TAP} root handle 1: tbf rate 10000kbit burst {MIN_BURST} limit {MIN_BURST + 250000}"
    assert write[1].startswith(f"qdisc replace dev {IFB} root handle 1: tbf rate 20000kbit ")
    assert write[2] == f"qdisc add dev {TAP} handle ffff: ingress"
    assert write[3].endswith(f"u32 match u32 0 0 action mirred egress redirect dev {IFB}")


def test_one_direction_alone_and_a_rewrite_clears_first() -> None:
    assert render(Bandwidth(egress_mbit=3), fresh=True) == ([], [render(Bandwidth(3), True)[1][0]])
    _, ingress_only = render(Bandwidth(ingress_mbit=3), fresh=True)
    assert all(TAP not in line or "ingress" in line or "redirect" in line for line in ingress_only)
    clear, write = render(shaping.UNLIMITED, fresh=False)  # a pooled tap given unlimited: just cleared
    assert clear == [f"qdisc del dev {TAP} root", f"qdisc del dev {TAP} ingress"] and write == []


def test_the_burst_holds_two_full_packets_and_grows_with_the_rate() -> None:
    def burst(mbit: float) -> int:
        return int(render(Bandwidth(mbit), True)[1][0].split(" burst ")[1].split()[0])

    assert burst(0.1) == burst(10) == MIN_BURST  # a 64 KiB packet always fits
    assert burst(1000) == int(1000e6 / 8 * shaping.BURST_SECONDS) > MIN_BURST
    assert "rate 1500kbit" in render(Bandwidth(1.5), True)[1][0]


def test_the_registry_falls_back_to_the_default_and_says_what_differs() -> None:
    s = Shaper()
    s.configure(Bandwidth(8, 16))
    assert s.limits("pool-1") == Bandwidth(8, 16) and not s.custom("pool-1")
    s.register("sbx", Bandwidth(8, 16))
    assert not s.custom("sbx")
    s.register("sbx", Bandwidth(24, None))
    assert s.custom("sbx") and s.limits("sbx") == Bandwidth(24, None)
    s.register("sbx", None)
    assert s.limits("sbx") == Bandwidth(8, 16)
    s.register("gone", Bandwidth(1, 1))
    s.forget("gone")
    assert not s.custom("gone")


async def test_a_host_that_cannot_shape_refuses_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SHAPER, "unavailable", lambda: "tc is not installed")
    with pytest.raises(InvalidRequest, match="bandwidth: tc is not installed"):
        await shaping.register("x-refused", Bandwidth(5, None))
    await shaping.register("x-unlimited", shaping.UNLIMITED)  # nothing to enforce: accepted
    SHAPER.forget("x-unlimited")


@pytest.fixture
def netns_pid() -> Iterator[int]:
    if os.geteuid() != 0 or shaping.probe() is not None:
        pytest.skip("needs root and a kernel with tbf, ifb and mirred")
    proc = subprocess.Popen(["unshare", "--net", "sleep", "60"])
    try:
        for _ in range(200):  # until unshare has exec'd sleep in its namespace
            if os.readlink(f"/proc/{proc.pid}/ns/net") != os.readlink("/proc/self/ns/net"):
                break
            time.sleep(0.01)
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def _qdiscs(pid: int) -> str:
    return subprocess.run(["nsenter", "-t", str(pid), "-n", "tc", "qdisc", "show"], capture_output=True,
                          text=True, check=True).stdout


def test_limits_are_on_a_tap_made_before_slirp_and_rewritten_in_place(netns_pid: int) -> None:
    shaping.write(netns_pid, Bandwidth(10, 20))
    out = _qdiscs(netns_pid)
    assert f"dev {TAP} root" in out and "rate 10Mbit" in out and f"dev {IFB} root" in out and "rate 20Mbit" in out
    assert "ingress ffff:" in out
    shaping.write(netns_pid, Bandwidth(egress_mbit=4), make_tap=False)  # a hand-out with other limits
    out = _qdiscs(netns_pid)
    assert "rate 4Mbit" in out and "ingress ffff:" not in out and "rate 10Mbit" not in out
    tap = subprocess.run(["nsenter", "-t", str(netns_pid), "-n", "ip", "-d", "link", "show", TAP],
                         capture_output=True, text=True, check=True).stdout
    assert "tap" in tap and "pi off" in tap and "persist on" in tap  # as slirp4netns opens it


def test_a_namespace_that_is_gone_is_a_shaping_error() -> None:
    with pytest.raises(shaping.ShapingError):
        shaping.write(2**22 + 12345, Bandwidth(1, 1))


def test_a_tap_left_by_a_dead_slirp_is_made_afresh(netns_pid: int) -> None:
    s = Shaper()
    s.register("sbx", Bandwidth(6, None))
    s.prepare("sbx", netns_pid)
    subprocess.run(["nsenter", "-t", str(netns_pid), "-n", "ip", "addr", "add", "10.0.2.100/24", "dev", TAP], check=True)
    s.prepare("sbx", netns_pid, again=True)  # slirp4netns --configure would fail on the old address
    addrs = subprocess.run(["nsenter", "-t", str(netns_pid), "-n", "ip", "-br", "addr", "show", TAP],
                           capture_output=True, text=True, check=True).stdout
    assert "10.0.2.100" not in addrs and "rate 6Mbit" in _qdiscs(netns_pid)
    s.register("sbx", None)  # unlimited now: the old tap goes, slirp4netns makes its own
    s.prepare("sbx", netns_pid, again=True)
    assert TAP not in _qdiscs(netns_pid)

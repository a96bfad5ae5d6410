"""core/bandwidth.py and its settings: a create's ``bandwidth`` checked (400s naming the field), kept
in the row's network record, turned back into limits with the server's default filling gaps."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from aenv.config import Settings
from aenv.core import bandwidth
from aenv.core import network as net
from aenv.core.models import BandwidthRequest
from aenv.errors import InvalidRequest
from aenv.runtime.shaping import SHAPER, Bandwidth


def _settings(tmp_path: Path, **kw: float) -> Settings:
    return Settings(state_dir=tmp_path, **kw)  # type: ignore[arg-type]


def test_a_request_is_kept_as_asked_and_zero_is_unlimited(tmp_path: Path) -> None:
    s = _settings(tmp_path)
    assert bandwidth.record(None, s) is None and bandwidth.record(BandwidthRequest(), s) is None
    assert bandwidth.record(BandwidthRequest(egress_mbit=10), s) == {"egressMbit": 10.0}
    assert bandwidth.record(BandwidthRequest(0, 2.5), s) == {"egressMbit": 0.0, "ingressMbit": 2.5}


@pytest.mark.parametrize(("req", "field"), [
    (BandwidthRequest(egress_mbit=-1), "bandwidth.egressMbit"),
    (BandwidthRequest(ingress_mbit=0.01), "bandwidth.ingressMbit"),
    (BandwidthRequest(egress_mbit=1e9), "bandwidth.egressMbit"),
])
def test_out_of_range_is_a_400_naming_the_field(tmp_path: Path, req: BandwidthRequest, field: str) -> None:
    with pytest.raises(InvalidRequest, match=field):
        bandwidth.record(req, _settings(tmp_path))


def test_the_operators_maximum_caps_both_and_refuses_unlimited(tmp_path: Path) -> None:
    s = _settings(tmp_path, max_bandwidth_mbit=50)
    assert bandwidth.record(BandwidthRequest(50, 1), s) == {"egressMbit": 50.0, "ingressMbit": 1.0}
    with pytest.raises(InvalidRequest, match=r"bandwidth.ingressMbit: 51.0 Mbit/s is above .* 50"):
        bandwidth.record(BandwidthRequest(ingress_mbit=51.0), s)
    with pytest.raises(InvalidRequest, match="bandwidth.egressMbit: unlimited is above"):
        bandwidth.record(BandwidthRequest(egress_mbit=0), s)
    # with a maximum, a sandbox that names no limit gets the maximum, never unlimited
    assert s.default_bandwidth() == (50, 50)
    assert _settings(tmp_path, max_bandwidth_mbit=50, egress_bandwidth_mbit=5).default_bandwidth() == (5, 50)
    assert _settings(tmp_path).default_bandwidth() == (None, None)


def test_a_default_above_the_maximum_does_not_start(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="ingress_bandwidth_mbit"):
        _settings(tmp_path, max_bandwidth_mbit=10, ingress_bandwidth_mbit=20)


def test_the_row_keeps_it_beside_the_network_rules_and_an_update_keeps_it(monkeypatch: pytest.MonkeyPatch) -> None:
    fields = net.row_fields(None, True, limits={"egressMbit": 4.0})
    assert fields["network"] == {"bandwidth": {"egressMbit": 4.0}}
    monkeypatch.setattr(SHAPER, "default", Bandwidth(8, 16))
    assert bandwidth.of_row(fields["network"]) == Bandwidth(4, 16)  # the default fills what it leaves out
    assert bandwidth.of_row({"bandwidth": {"egressMbit": 0.0}}) == Bandwidth(None, 16)
    assert bandwidth.of_row({}) is None  # the default, whatever it is when the namespace is made
    assert net.record_of(net.NetworkRequest(deny_out=["0.0.0.0/0"]), keep=fields["network"])["bandwidth"] == {
        "egressMbit": 4.0}

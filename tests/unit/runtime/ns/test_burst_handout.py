"""A hand-out while another team's burst is starting answers ``/init`` at a high CPU weight
(``NsRuntime._contended``): only then, and never with ``team_burst_yield`` off."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.runtime.ns.runtime import NsRuntime


class FakeCgroup:
    def __init__(self) -> None:
        self.low: list[bool] = []

    def set_weight(self, low: bool) -> None:
        self.low.append(low)


@pytest.mark.parametrize("yielding", [True, False])
def test_contended_only_while_a_burst_start_is_in_flight(tmp_path: Path, yielding: bool) -> None:
    rt = NsRuntime(Settings(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache", team_burst_yield=yielding),
                   pool_size=0)
    assert not rt._contended()  # no burst: a create's hand-out keeps the ordinary weight
    with rt.snapshots.bursts.starting(FakeCgroup()):  # a burst start in flight
        assert rt._contended() is yielding
    assert not rt._contended()  # over with the burst's last start

"""A create while another team's burst is starting (``NsRuntime._contended``): it waits briefly for the
pool's refill under way (``WarmPool.take_soon``) instead of restoring beside it; otherwise, and with
``team_burst_yield`` off, a plain take."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from aenv.config import Settings
from aenv.runtime.base import SandboxImage
from aenv.runtime.ns.runtime import NsRuntime


class FakeCgroup:
    def __init__(self) -> None:
        self.low: list[bool] = []

    def set_weight(self, low: bool) -> None:
        self.low.append(low)


class RecordingPool:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def take(self, template: SandboxImage, allow_internet: bool, uid_slot: int = 0) -> None:
        self.calls.append("take")

    async def take_soon(self, template: SandboxImage, allow_internet: bool, uid_slot: int = 0) -> None:
        self.calls.append("take_soon")


@pytest.mark.parametrize("yielding", [True, False])
async def test_a_create_during_a_burst_waits_for_the_refill_under_way(tmp_path: Path, yielding: bool) -> None:
    rt = NsRuntime(Settings(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache", team_burst_yield=yielding),
                   pool_size=0)
    pool = RecordingPool()
    rt.pool = pool  # type: ignore[assignment]
    spec = SimpleNamespace(template=SandboxImage("t", Path("/r")), allow_internet=False, uid_slot=0)
    assert not rt._contended()
    await rt._pooled(spec)  # type: ignore[arg-type]
    with rt.snapshots.bursts.starting(FakeCgroup()):  # a burst start in flight
        assert rt._contended() is yielding
        await rt._pooled(spec)  # type: ignore[arg-type]
    assert not rt._contended()  # over with the burst's last start
    await rt._pooled(spec)  # type: ignore[arg-type]
    assert pool.calls == ["take", "take_soon" if yielding else "take", "take"]

"""The periodic sampler: one batch per cycle where the runtime offers it, per sandbox otherwise, and a
history the garbage collector does not have to walk."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from aenv.core import orchestrator as orchestrator_module
from aenv.core.models import CreateRequest
from aenv.core.orchestrator import Orchestrator
from aenv.core.table import SampleHistory
from aenv.runtime.base import BatchSampling, ResourceSample
from tests.fixtures.runtime import FakeRuntime
from tests.unit.core.conftest import build_orchestrator


def _sample(ts: float) -> ResourceSample:
    return ResourceSample(ts, 2, 12.5, 100, 200, 10, 5, 1000)


def test_history_gives_back_what_it_kept_between_bounds_and_forgets_the_oldest() -> None:
    h = SampleHistory(maxlen=3)
    assert h.last_timestamp() is None and h.between(0, float("inf")) == []
    for ts in (1.0, 2.0, 3.0, 4.0):
        h.append(_sample(ts))
    assert len(h) == 3 and h.last_timestamp() == 4.0
    assert h.between(0, float("inf")) == [_sample(2.0), _sample(3.0), _sample(4.0)]
    assert h.between(2.5, 3.0) == [_sample(3.0)]


def test_history_rows_leave_the_collectors_tracking() -> None:
    h = SampleHistory()
    h.append(_sample(time.time()))
    gc.collect()
    rows = [r for r in gc.get_referents(h._rows) if isinstance(r, tuple)]
    assert len(rows) == 1 and not gc.is_tracked(rows[0])


class BatchRuntime(FakeRuntime):
    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[str]] = []
        self.singles = 0

    async def metrics(self, sandbox_id: str) -> ResourceSample:
        self.singles += 1
        return await super().metrics(sandbox_id)

    async def metrics_many(self, sandbox_ids: Sequence[str]) -> dict[str, ResourceSample]:
        self.batches.append(list(sandbox_ids))
        return {sid: _sample(time.time()) for sid in sandbox_ids if sid != "gone"}


class SingleRuntime(FakeRuntime):
    def __init__(self) -> None:
        super().__init__()
        self.singles = 0

    async def metrics(self, sandbox_id: str) -> ResourceSample:
        self.singles += 1
        return await super().metrics(sandbox_id)


async def _sampled(tmp_path: Path, runtime: FakeRuntime, monkeypatch: pytest.MonkeyPatch) -> tuple[Orchestrator, list[str]]:
    monkeypatch.setattr(orchestrator_module, "METRICS_INTERVAL", 0.01)
    o, store = build_orchestrator(tmp_path, runtime)
    ids = [(await o.create(CreateRequest(template="base"))).id for _ in range(3)]
    await o.pause(ids[2])  # not running: not sampled
    await o.start()
    for _ in range(200):
        if all(len(o.get(i).samples) >= 2 for i in ids[:2]):
            break
        await asyncio.sleep(0.01)
    await o.close()
    store.close()
    return o, ids


async def test_a_batch_runtime_is_sampled_once_per_cycle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rt = BatchRuntime()
    assert isinstance(rt, BatchSampling)
    o, ids = await _sampled(tmp_path, rt, monkeypatch)
    assert all(len(o.get(i).samples) >= 2 for i in ids[:2]) and len(o.get(ids[2]).samples) == 0
    assert rt.singles == 0 and len(rt.batches) >= 2
    assert all(sorted(b) == sorted(ids[:2]) for b in rt.batches)


async def test_a_runtime_without_batches_is_sampled_per_sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rt = SingleRuntime()
    assert not isinstance(rt, BatchSampling)
    o, ids = await _sampled(tmp_path, rt, monkeypatch)
    assert all(len(o.get(i).samples) >= 2 for i in ids[:2]) and len(o.get(ids[2]).samples) == 0
    assert rt.singles >= 4

"""A CRIU run that never ends is killed and is the request's error; a process image's dump is awaited to
its end before its sandbox is closed, even when the pool closes meanwhile (a dump whose sandbox was
killed under it never returned, and the shutdown that waited for its thread hung: seen in CI)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from aenv.runtime.ns import checkpoint
from aenv.runtime.ns.checkpoint import CheckpointError, run_criu
from aenv.runtime.ns.procimage import _finish_even_if_cancelled


def test_a_criu_run_past_its_timeout_is_killed_and_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpoint, "CRIU_TIMEOUT", 0.3)
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match="criu dump did not finish in 0.3 s"):
        run_criu(["sleep", "30"], tmp_path / "dump.log", "dump")
    assert time.monotonic() - t0 < 10


async def test_a_dump_is_finished_before_the_cancellation_goes_on() -> None:
    done: list[str] = []

    def dump() -> None:
        time.sleep(0.3)
        done.append("dumped")

    async def build() -> None:
        await _finish_even_if_cancelled(asyncio.to_thread(dump))
        done.append("not reached")

    task = asyncio.create_task(build())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert done == ["dumped"]  # the thread ended first, and the cancellation still reached the caller

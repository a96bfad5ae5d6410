"""When envd and the agent mark themselves mergeable (``envd/mergeable.py``): at once without an idle
wait; with one, only after that long without activity counted from the host's first word (``rearm``),
and at once again after a restore of a marked process. prctl is replaced: the test runner itself is
never marked."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from aenv.envd import mergeable


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    calls: list[int] = []
    monkeypatch.setattr(mergeable, "_prctl_merge", lambda: calls.append(1) or 0)
    for name, value in (("_wanted", False), ("_idle_s", 0.0), ("_marked", False), ("_last", 0.0), ("_pending", False)):
        monkeypatch.setattr(mergeable, name, value)
    yield calls


def test_without_an_idle_wait_it_marks_at_once_and_after_every_restore(fresh: list[int]) -> None:
    assert mergeable.enable(0) and mergeable.marked()
    assert mergeable.rearm() and len(fresh) == 2


def test_nothing_is_marked_unless_enabled(fresh: list[int]) -> None:
    assert not mergeable.rearm() and fresh == []


def test_with_an_idle_wait_it_marks_only_once_idle_that_long(fresh: list[int]) -> None:
    async def scenario() -> None:
        assert not mergeable.enable(0.2)  # started (a pooled sandbox): never marked before the host says so
        await asyncio.sleep(0.3)
        assert fresh == []
        assert not mergeable.rearm()  # the hand-out (/init): idle time counts from here
        for _ in range(4):  # busy: a request every 0.1 s keeps it unmarked
            await asyncio.sleep(0.1)
            mergeable.touch()
        assert fresh == [] and not mergeable.marked()
        await asyncio.sleep(0.35)  # idle 0.2 s
        assert fresh == [1] and mergeable.marked()
        assert mergeable.rearm() and fresh == [1, 1]  # a restore of a marked process: marked at once

    asyncio.run(scenario())


def test_a_failed_prctl_leaves_it_unmarked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mergeable, "_prctl_merge", lambda: 22)
    assert not mergeable.enable(0) and not mergeable.marked()

"""Kills that ride out a gateway restarting (``aenv.rl._kill``): the chaos run left a group's parent and a
child running when their kills met the gateway down; now they are tried again until a shared deadline."""

from __future__ import annotations

import asyncio
from typing import Any

import e2b
import httpx
import pytest

from aenv.rl import Episode, _kill


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(_kill, "time", c)
    return c


def flaky(failures: list[BaseException]) -> tuple[Any, list[int]]:
    calls: list[int] = []

    def kill() -> bool:
        calls.append(1)
        if failures:
            raise failures.pop(0)
        return True

    return kill, calls


def test_refusals_are_tried_again_until_the_kill_goes_through(clock: Clock) -> None:
    kill, calls = flaky([httpx.ConnectError("refused"), e2b.SandboxException("502: gateway restarting")])
    assert _kill.kill_until(kill, _kill.deadline()) is None
    assert len(calls) == 3 and clock.slept == [0.2, 0.4]


def test_the_deadline_ends_it_and_the_last_error_is_returned(clock: Clock) -> None:
    kill, calls = flaky([httpx.ConnectError("refused")] * 100)
    got = _kill.kill_until(kill, clock.now + 5)
    assert got == "ConnectError: refused" and sum(clock.slept) <= 5 and len(calls) == len(clock.slept) + 1


def test_not_an_infrastructure_error_is_not_retried(clock: Clock) -> None:
    kill, calls = flaky([ValueError("bug")])
    assert _kill.kill_until(kill, _kill.deadline()) == "ValueError: bug" and len(calls) == 1


def test_the_async_variant(monkeypatch: pytest.MonkeyPatch, clock: Clock) -> None:
    failures: list[BaseException] = [httpx.ConnectError("refused")]

    async def kill() -> bool:
        if failures:
            raise failures.pop(0)
        return True

    async def no_wait(s: float) -> None:
        clock.sleep(s)

    monkeypatch.setattr(_kill.asyncio, "sleep", no_wait)
    assert asyncio.run(_kill.akill_until(kill, _kill.deadline())) is None and clock.slept == [0.2]


class Sbx:
    def __init__(self, kill: Any) -> None:
        self.sandbox_id, self.kill = "sbx", kill

    def set_timeout(self, t: int) -> None:
        pass


def test_an_episode_kills_its_sandbox_once_the_gateway_is_back(monkeypatch: pytest.MonkeyPatch, clock: Clock) -> None:
    kill, calls = flaky([httpx.ConnectError("refused")] * 3)
    monkeypatch.setattr(e2b.Sandbox, "create", lambda *a, **kw: Sbx(kill))
    with Episode("base", rollout_id="r1", keepalive=3600) as ep:
        pass
    assert len(calls) == 4 and "kill_error" not in ep.metrics


def test_an_episode_says_why_its_sandbox_was_not_killed(monkeypatch: pytest.MonkeyPatch, clock: Clock) -> None:
    kill, _ = flaky([httpx.ConnectError("refused")] * 1000)
    monkeypatch.setattr(e2b.Sandbox, "create", lambda *a, **kw: Sbx(kill))
    with Episode("base", rollout_id="r1", keepalive=3600) as ep:
        pass
    assert ep.metrics["kill_error"] == "ConnectError: refused" and ep.outcome.ok

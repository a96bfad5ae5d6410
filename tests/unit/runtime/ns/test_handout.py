"""``HandOutFilter``: a hand-out's policy is written while the create goes on, streams wait for it
and fail (and the network is cut) if it failed; a restorer never used exits."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from aenv.runtime.network import NetworkError, Restorer
from aenv.runtime.ns.handout import HandOutFilter


class FakeRestorer:
    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.proc = SimpleNamespace(returncode=None)

    def discard(self) -> None:
        self.log.append("discard")
        self.proc.returncode = 0


def handout(log: list[str]) -> tuple[HandOutFilter, FakeRestorer]:
    f = HandOutFilter("pool-1")
    f.restorer = restorer = FakeRestorer(log)  # type: ignore[assignment]
    return f, restorer


async def cut(log: list[str]) -> None:
    log.append("cut")


async def test_streams_wait_for_the_policy(caplog: pytest.LogCaptureFixture) -> None:
    log: list[str] = []
    f, restorer = handout(log)
    written = asyncio.Event()

    async def install(r: Restorer | None) -> None:
        assert r is restorer and f.restorer is None  # handed over, not left for a teardown
        await written.wait()
        log.append("written")
        restorer.proc.returncode = 0  # it was used

    f.hand_out("s1", install, lambda: cut(log))
    assert f.pending
    opened = asyncio.create_task(f.ready())
    await asyncio.sleep(0.01)
    assert not opened.done()
    written.set()
    await opened
    await f.settled()
    assert log == ["written"] and not f.pending


async def test_a_failed_policy_fails_streams_and_cuts_the_network(caplog: pytest.LogCaptureFixture) -> None:
    log: list[str] = []
    f, _ = handout(log)

    async def install(r: Restorer | None) -> None:
        raise NetworkError("iptables-legacy-restore in sandbox netns failed: boom")

    f.hand_out("s1", install, lambda: cut(log))
    await f.settled()
    for _ in range(2):  # every stream, not only the first
        with pytest.raises(OSError, match="network policy could not be applied: .*boom"):
            await f.ready()
    assert log == ["cut", "discard"]  # never used: it exits
    assert "egress-s1: the network policy could not be applied at hand-out" in caplog.text


async def test_no_policy_lets_the_restorer_go() -> None:
    log: list[str] = []
    f, restorer = handout(log)
    f.hand_out("s1", None, lambda: cut(log))
    await f.ready()  # nothing to wait for
    for _ in range(100):
        if log:
            break
        await asyncio.sleep(0.01)
    assert log == ["discard"] and f.restorer is None and not f.pending
    await f.aclose()  # nothing left to discard
    assert log == ["discard"]

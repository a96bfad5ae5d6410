"""``HandOutFilter``: a hand-out's policy is written while the create goes on, streams wait for it
and fail (and the network is cut) if it failed; a restorer never used exits; an older server's
nf_tables rules go only after ours are written."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from aenv.config import Settings
from aenv.runtime import network
from aenv.runtime.egress import ENFORCER
from aenv.runtime.network import NetworkError, Restorer
from aenv.runtime.ns import runtime as ns_runtime
from aenv.runtime.ns.handout import HandOutFilter
from aenv.runtime.ns.runtime import NsRuntime
from aenv.runtime.process import ProcRef


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


async def test_an_older_servers_rules_go_once_ours_are_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Adopted after an upgrade with nf_tables rules (``network.foreign_rules``): they are emptied only
    after a filter of ours is in force, and once."""
    log: list[str] = []
    rt = NsRuntime(Settings(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache"), pool_size=0)
    sbx = SimpleNamespace(allow_internet=True, init=ProcRef(4242, 1), net_pid=4242, alive=lambda: True, egress=HandOutFilter("s1"))
    sbx.egress.foreign = True
    rt.table.running["s1"] = sbx  # type: ignore[assignment]

    async def install(key: str, pid: int, host_addrs: list[str]) -> None:
        log.append(f"install {key} {pid}")

    async def drop(pid: int) -> None:
        log.append(f"drop {pid}")

    monkeypatch.setattr(ENFORCER, "install", install)
    monkeypatch.setattr(ns_runtime, "drop_foreign_rules", drop)
    await rt.set_egress("s1", None)
    await rt.set_egress("s1", None)
    assert log == ["install s1 4242", "drop 4242", "install s1 4242"] and not sbx.egress.foreign
    ENFORCER.forget("s1")


async def test_no_foreign_rules_where_the_backend_is_nf_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(network, "_restore_tool", network.NFT_RESTORE)
    assert not await network.foreign_rules(4242)  # nothing looked at: it writes nf_tables itself


async def test_a_sandbox_closed_before_the_late_discard_ends_its_restorer_once() -> None:
    """The unused restorer's end waits 0.2 s (off the create's path); a close meanwhile ends it at once,
    and the timer then does nothing: no restorer outlives its sandbox, none is ended twice."""
    log: list[str] = []
    f, _ = handout(log)
    f.hand_out("s1", None, lambda: cut(log))
    assert log == []  # not on the hand-out's path
    await f.aclose()
    assert log == ["discard"]
    await asyncio.sleep(0.3)
    assert log == ["discard"]

"""``AenvClient`` against the real control plane (FakeRuntime behind it) and a mock transport for errors."""

from __future__ import annotations

import httpx
import pytest
from starlette.testclient import TestClient

from aenv.client import AenvClient, ApiError, ConflictError, NotFoundError, ServerUnreachable
from tests.fixtures.runtime import FakeRuntime


@pytest.fixture
def aenv_client(client: TestClient) -> AenvClient:
    return AenvClient("http://testserver", "e2b_" + "0" * 40, transport=client._transport)


def _sandbox(client: TestClient) -> str:
    r = client.post("/sandboxes", json={"templateID": "base"}, headers={"X-API-KEY": "e2b_" + "0" * 40})
    assert r.status_code == 201, r.text
    return str(r.json()["sandboxID"])


def test_snapshot_fork_rollback_delete(client: TestClient, runtime: FakeRuntime, aenv_client: AenvClient) -> None:
    sid = _sandbox(client)
    snap = aenv_client.snapshot(sid, name="n1", mode="filesystem")
    assert snap.mode == "filesystem" and snap.sandbox_id == sid and snap.names == ["n1"]
    assert snap.paused_ms is None  # the runtime reported no stop for a filesystem snapshot
    assert [s.snapshot_id for s in aenv_client.list_snapshots(sandbox_id=sid)] == [snap.snapshot_id]
    assert aenv_client.get_snapshot(snap.snapshot_id).snapshot_id == snap.snapshot_id
    fork = aenv_client.fork(sid, 3)
    assert len(fork.sandbox_ids) == 3 and fork.errors == [] and fork.mode == "full" and fork.snapshot_id
    assert aenv_client.rollback(sid, snap.snapshot_id)["sandboxID"] == sid
    with pytest.raises(ConflictError) as err:
        aenv_client.delete_snapshot(snap.snapshot_id)  # the rolled-back sandbox depends on it
    assert err.value.status == 409 and sid in err.value.message
    with pytest.raises(NotFoundError):
        aenv_client.get_snapshot("nope")


def test_full_snapshot_refused_is_a_conflict(client: TestClient, runtime: FakeRuntime, aenv_client: AenvClient,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "modes", ("filesystem",))
    sid = _sandbox(client)
    with pytest.raises(ConflictError, match="filesystem"):
        aenv_client.snapshot(sid)


def test_unreachable() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with AenvClient("http://127.0.0.1:1", transport=httpx.MockTransport(refuse)) as c, pytest.raises(ServerUnreachable):
        c.list_snapshots()


def test_snapshot_reports_how_long_the_sandbox_was_stopped(client: TestClient, aenv_client: AenvClient) -> None:
    snap = aenv_client.snapshot(_sandbox(client))  # full: the fake runtime says 1.5 ms
    assert snap.paused_ms == 1.5 and aenv_client.get_snapshot(snap.snapshot_id).paused_ms == 1.5


def test_wait_written_returns_the_final_size(client: TestClient, runtime: FakeRuntime, aenv_client: AenvClient) -> None:
    """A runtime that writes the files after the call (vm): ``writing`` until they land, then the
    final size; a write that never ends is a TimeoutError, not a hang."""
    runtime.defer_files = True
    snap = aenv_client.snapshot(_sandbox(client))
    assert snap.writing and snap.size_bytes < 10_000
    with pytest.raises(TimeoutError):
        aenv_client.wait_written(snap.snapshot_id, timeout=0.05)
    runtime.finish_files()
    done = aenv_client.wait_written(snap.snapshot_id, timeout=5)
    assert not done.writing and done.size_bytes >= 10_000


class _Clock:
    """``time.monotonic`` and ``time.sleep`` for the client: sleeping advances the clock, instantly."""

    def __init__(self) -> None:
        self.now, self.slept = 1000.0, []  # type: ignore[var-annotated]

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(round(s, 3))
        self.now += s


def _scripted(answers: list[object]) -> tuple[httpx.MockTransport, list[str]]:
    """A transport that answers each request with the next of ``answers`` (an exception class is raised)."""
    sent: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.path)
        got = answers.pop(0)
        if isinstance(got, type):
            raise got("scripted", request=request)
        assert isinstance(got, httpx.Response)
        return got

    return httpx.MockTransport(handle), sent


def _fork_ok() -> httpx.Response:
    return httpx.Response(201, json=[{"sandbox": {"sandboxID": "kid"}, "mode": "full", "snapshotID": "snap"}])


def test_a_refused_connection_is_tried_again_within_retry_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway restarting refuses connections for a second or two: nothing was sent, so the fork is sent
    again (backing off) and succeeds once it answers."""
    clock = _Clock()
    monkeypatch.setattr("aenv.client._client.time", clock)
    transport, sent = _scripted([httpx.ConnectError, httpx.ConnectError, _fork_ok()])
    with AenvClient("http://gw", transport=transport, retry_for=30) as c:
        assert c.fork("parent", 1).sandbox_ids == ["kid"]
    assert sent == ["/sandboxes/parent/fork"] * 3 and clock.slept == [0.1, 0.2]


def test_a_503_with_retry_after_is_tried_again_after_the_time_it_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr("aenv.client._client.time", clock)
    busy = httpx.Response(503, json={"code": 503, "message": "cluster directory unreachable"}, headers={"Retry-After": "2"})
    transport, sent = _scripted([busy, _fork_ok()])
    with AenvClient("http://gw", transport=transport, retry_for=30) as c:
        assert c.fork("parent", 1).sandbox_ids == ["kid"]
    assert len(sent) == 2 and clock.slept == [2.0]


@pytest.mark.parametrize("answer", [
    httpx.Response(503, json={"code": 503, "message": "guest unresponsive"}, headers={"Should-Retry": "false"}),
    httpx.Response(503, json={"code": 503, "message": "no retry-after"}),
    httpx.Response(500, json={"code": 500, "message": "boom"}, headers={"Retry-After": "1"}),
])
def test_other_errors_are_answered_at_once(monkeypatch: pytest.MonkeyPatch, answer: httpx.Response) -> None:
    monkeypatch.setattr("aenv.client._client.time", _Clock())
    transport, sent = _scripted([answer])
    with AenvClient("http://gw", transport=transport, retry_for=30) as c, pytest.raises(ApiError) as err:
        c.fork("parent", 1)
    assert err.value.status == answer.status_code and len(sent) == 1


def test_a_timeout_is_never_sent_again_and_the_budget_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """A timed-out request may have been done (a fork whose answer was lost): not repeated. Refusals stop
    once ``retry_for`` is spent; the default (0) tries once."""
    clock = _Clock()
    monkeypatch.setattr("aenv.client._client.time", clock)
    transport, sent = _scripted([httpx.ReadTimeout])
    with AenvClient("http://gw", transport=transport, retry_for=30) as c, pytest.raises(ServerUnreachable):
        c.fork("parent", 1)
    assert len(sent) == 1
    transport, sent = _scripted([httpx.ConnectError] * 100)
    with AenvClient("http://gw", transport=transport, retry_for=3) as c, pytest.raises(ServerUnreachable):
        c.fork("parent", 1)
    assert sum(clock.slept) == pytest.approx(3.0) and len(sent) == 7  # 0.1 0.2 0.4 0.8 1.0, then the rest of 3 s
    transport, sent = _scripted([httpx.ConnectError])
    with AenvClient("http://gw", transport=transport) as c, pytest.raises(ServerUnreachable):
        c.fork("parent", 1)
    assert len(sent) == 1

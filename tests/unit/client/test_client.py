"""``AenvClient`` against the real control plane (FakeRuntime behind it) and a mock transport for errors."""

from __future__ import annotations

import httpx
import pytest
from starlette.testclient import TestClient

from aenv.client import AenvClient, ConflictError, NotFoundError, ServerUnreachable
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

"""Snapshots, fork and rollback through the REST API (orchestrator flows on a fake runtime)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from starlette.testclient import TestClient

from aenv.api.app import create_app
from aenv.config import Settings
from aenv.runtime.base import UNFINISHED_MARKER
from tests.fixtures.runtime import FakeRuntime


def _create(client: TestClient, template: str = "base") -> str:
    resp = client.post("/v2/sandboxes", json={"templateID": template})
    assert resp.status_code == 201, resp.text
    return str(resp.json()["sandboxID"])


def test_snapshot_lineage_and_start_from_snapshot(client: TestClient, runtime: FakeRuntime) -> None:
    sid = _create(client)
    s1 = client.post(f"/sandboxes/{sid}/snapshots", json={"name": "step-1"}).json()
    assert s1["names"] == ["step-1"] and s1["mode"] == "full" and s1["parentID"] is None
    assert s1["pausedMs"] == 1.5  # what the runtime reported, when it did
    s2 = client.post(f"/sandboxes/{sid}/snapshots", json={"memory": False}).json()
    assert s2["mode"] == "filesystem" and s2["parentID"] == s1["snapshotID"]
    assert "pausedMs" not in s2
    detail = client.get(f"/snapshots/{s2['snapshotID']}").json()
    assert detail["lineage"] == [s2["snapshotID"], s1["snapshotID"]]
    assert client.get(f"/snapshots/{s1['snapshotID']}").json()["children"] == [s2["snapshotID"]]
    listed = client.get("/snapshots", params={"sandboxID": sid}).json()
    assert {s["snapshotID"] for s in listed} == {s1["snapshotID"], s2["snapshotID"]}
    # A snapshot is a template: by ID and by name.
    child = _create(client, s1["snapshotID"])
    assert ("restore", child) in runtime.calls
    by_name = _create(client, "step-1")
    assert client.get(f"/sandboxes/{by_name}").json()["templateID"] == s1["snapshotID"]
    # In use → cannot delete; after the users are gone → deleted.
    assert client.delete(f"/templates/{s1['snapshotID']}").status_code == 409
    client.delete(f"/sandboxes/{child}")
    client.delete(f"/sandboxes/{by_name}")
    assert client.delete(f"/templates/{s1['snapshotID']}").status_code == 204
    assert client.get(f"/snapshots/{s1['snapshotID']}").status_code == 404


def _until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_snapshot_files_written_after_the_call(client: TestClient, runtime: FakeRuntime, settings: Settings) -> None:
    """A runtime may return before the snapshot's files are written (vm: the sandbox runs on while
    its RAM layer and disk are written). The snapshot is usable at once; its size is recorded when
    the files are done; if they fail, the snapshot is deleted and the lineage steps back."""
    runtime.defer_files = True
    sid = _create(client)
    s1 = client.post(f"/sandboxes/{sid}/snapshots", json={"name": "a"}).json()
    snap_dir = settings.snapshots_dir / s1["snapshotID"]
    assert (snap_dir / UNFINISHED_MARKER).exists() and s1["sizeBytes"] < 10_000 and s1["writing"] is True
    runtime.finish_files()
    _until(lambda: client.get(f"/snapshots/{s1['snapshotID']}").json()["writing"] is False)
    assert client.get(f"/snapshots/{s1['snapshotID']}").json()["sizeBytes"] >= 10_000
    assert not (snap_dir / UNFINISHED_MARKER).exists()

    s2 = client.post(f"/sandboxes/{sid}/snapshots", json={"name": "b"}).json()
    assert client.get(f"/sandboxes/{sid}").status_code == 200
    runtime.finish_files(ok=False)
    _until(lambda: client.get(f"/snapshots/{s2['snapshotID']}").status_code == 404)
    assert not (settings.snapshots_dir / s2["snapshotID"]).exists()
    assert client.post("/v2/sandboxes", json={"templateID": "b"}).status_code == 404  # its template went too
    s3 = client.post(f"/sandboxes/{sid}/snapshots", json={}).json()
    assert s3["parentID"] == s1["snapshotID"]  # not the failed one
    runtime.finish_files()


def test_unfinished_snapshot_discarded_at_start(settings: Settings, runtime: FakeRuntime, tmp_path: Path) -> None:
    """A server stopped while a snapshot's files were still being written: at the next start the
    snapshot (marked UNFINISHED_MARKER) is deleted instead of offered half-written."""
    runtime.defer_files = True
    app = create_app(settings, runtime=runtime, ensure_base=False)  # type: ignore[arg-type]
    with TestClient(app) as c:
        app.app.state.catalog.register(alias="base", kind="bootstrap", rootfs=tmp_path / "rootfs", template_id="base")  # type: ignore[attr-defined]
        sid = _create(c)
        done = c.post(f"/sandboxes/{sid}/snapshots", json={}).json()
        runtime.finish_files()
        _until(lambda: not (settings.snapshots_dir / done["snapshotID"] / UNFINISHED_MARKER).exists())
        cut = c.post(f"/sandboxes/{sid}/snapshots", json={}).json()
        # the server stops here, its write of ``cut`` cut short (as by a kill)
        loop, pending, _ = runtime._deferred.pop()
        loop.call_soon_threadsafe(pending.cancel)
    app = create_app(settings, runtime=runtime, ensure_base=False)  # type: ignore[arg-type]
    with TestClient(app) as c:
        assert c.get(f"/snapshots/{cut['snapshotID']}").status_code == 404
        assert not (settings.snapshots_dir / cut["snapshotID"]).exists()
        assert c.get(f"/snapshots/{done['snapshotID']}").status_code == 200
        assert c.get(f"/sandboxes/{sid}").json()["sandboxID"] == sid


def test_full_snapshot_refused_when_runtime_cannot(client: TestClient, runtime: FakeRuntime) -> None:
    runtime.modes = ("filesystem",)
    sid = _create(client)
    resp = client.post(f"/sandboxes/{sid}/snapshots", json={})
    assert resp.status_code == 409 and "filesystem" in resp.json()["message"]
    assert client.post(f"/sandboxes/{sid}/snapshots", json={"mode": "filesystem"}).status_code == 201
    assert client.post(f"/sandboxes/{sid}/snapshots", json={"mode": "weird"}).status_code == 400


def test_fork_children_and_errors(client: TestClient, runtime: FakeRuntime) -> None:
    sid = _create(client)
    resp = client.post(f"/sandboxes/{sid}/fork", json={"count": 3, "timeout": 60})
    assert resp.status_code == 201
    kids = [r["sandbox"]["sandboxID"] for r in resp.json()]
    assert len(set(kids)) == 3 and sid not in kids
    tokens = {r["sandbox"]["envdAccessToken"] for r in resp.json()}
    assert len(tokens) == 3
    for k in kids:
        assert client.get(f"/sandboxes/{k}").json()["state"] == "running"
    assert client.post(f"/sandboxes/{sid}/fork", json={"count": 0}).status_code == 400
    assert client.post(f"/sandboxes/{sid}/fork", json={"count": 1000}).status_code == 400
    assert client.post("/sandboxes/nope/fork", json={"count": 1}).status_code == 404


def test_rollback_only_within_lineage(client: TestClient, runtime: FakeRuntime) -> None:
    a = _create(client)
    b = _create(client)
    sa = client.post(f"/sandboxes/{a}/snapshots", json={}).json()["snapshotID"]
    sb = client.post(f"/sandboxes/{b}/snapshots", json={}).json()["snapshotID"]
    client.post(f"/sandboxes/{a}/snapshots", json={})
    resp = client.post(f"/sandboxes/{a}/rollback", json={"snapshotID": sa})
    assert resp.status_code == 200 and resp.json()["sandboxID"] == a
    assert ("rollback", a) in runtime.calls
    resp = client.post(f"/sandboxes/{a}/rollback", json={"snapshotID": sb})
    assert resp.status_code == 409 and "lineage" in resp.json()["message"]
    assert client.post(f"/sandboxes/{a}/rollback", json={"snapshotID": "nope"}).status_code == 404

"""The snapshot repository wired into the server (fake runtime, local-directory store): background
publish, a second server fetching by ID, fetch-back of a lost directory, re-publish after a restart,
delete freeing the repository's copy."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from starlette.testclient import TestClient

from aenv.api.app import create_app
from aenv.config import Settings
from tests.fixtures.runtime import FakeRuntime


@contextmanager
def server(tmp: Path, name: str, store: str, runtime: FakeRuntime | None = None) -> Iterator[tuple[TestClient, Any]]:
    settings = Settings(state_dir=tmp / name / "state", cache_dir=tmp / "cache", reaper_interval=0.05,
                        max_timeout=3600, snapshot_store=store)
    rootfs = tmp / "rootfs"
    rootfs.mkdir(exist_ok=True)
    app = create_app(settings, runtime=runtime or FakeRuntime(), ensure_base=False)  # type: ignore[arg-type]
    with TestClient(app) as c:
        app.app.state.catalog.register(alias="base", kind="bootstrap", rootfs=rootfs, template_id="base")
        yield c, app.app.state


def _create(c: TestClient, template: str = "base") -> str:
    resp = c.post("/v2/sandboxes", json={"templateID": template})
    assert resp.status_code == 201, resp.text
    return str(resp.json()["sandboxID"])


def _snapshot(c: TestClient, sid: str, **body: Any) -> str:
    resp = c.post(f"/sandboxes/{sid}/snapshots", json=body)
    assert resp.status_code == 201, resp.text
    return str(resp.json()["snapshotID"])


def _wait_published(c: TestClient, snap: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if c.get(f"/snapshots/{snap}").json().get("published"):
            return
        time.sleep(0.02)
    raise AssertionError(f"snapshot {snap} was not published")


def _objects(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_publish_fetch_on_second_server_and_delete(tmp_path: Path) -> None:
    store = tmp_path / "shared-store"
    with server(tmp_path, "a", f"file://{store}") as (a, _):
        sid = _create(a)
        snap = _snapshot(a, sid, name="step-1")
        _wait_published(a, snap)
        assert f"manifests/{snap}.json" in _objects(store)
        rt_b = FakeRuntime()
        with server(tmp_path, "b", f"file://{store}", rt_b) as (b, state_b):
            assert b.get(f"/snapshots/{snap}").status_code == 404  # learnt lazily, by ID
            child = _create(b, snap)
            assert ("restore", child) in rt_b.calls
            row = b.get(f"/snapshots/{snap}").json()
            assert row["published"] and row["names"] == ["step-1"]
            local = state_b.settings.snapshots_dir / snap
            assert (local / "state").read_text().startswith(sid)
            assert _create(b, "step-1")  # and by name, now that it is here
            assert b.post("/v2/sandboxes", json={"templateID": "nosuchsnapshot"}).status_code == 404
        # delete on A: the repository's copy goes too, layers included
        for s in a.get("/v2/sandboxes").json():
            a.delete(f"/sandboxes/{s['sandboxID']}")
        assert a.delete(f"/templates/{snap}").status_code == 204
        assert _objects(store) == set()


def test_lost_directory_is_fetched_back_for_create_and_rollback(tmp_path: Path) -> None:
    store = f"file://{tmp_path / 'store'}"
    rt = FakeRuntime()
    with server(tmp_path, "a", store, rt) as (a, state):
        sid = _create(a)
        snap = _snapshot(a, sid)
        _wait_published(a, snap)
        shutil.rmtree(state.settings.snapshots_dir / snap)
        child = _create(a, snap)
        assert ("restore", child) in rt.calls and (state.settings.snapshots_dir / snap / "state").is_file()
        shutil.rmtree(state.settings.snapshots_dir / snap)
        resp = a.post(f"/sandboxes/{sid}/rollback", json={"snapshotID": snap})
        assert resp.status_code < 300, resp.text
        assert (state.settings.snapshots_dir / snap / "state").is_file()


def test_restart_publishes_what_was_left_unpublished(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    rt = FakeRuntime()
    with server(tmp_path, "a", "", rt) as (a, _):  # publishing off: the snapshot stays unpublished
        snap = _snapshot(a, _create(a))
        assert a.get(f"/snapshots/{snap}").json()["published"] is False
    with server(tmp_path, "a", f"file://{store_dir}", rt) as (a, state):
        _wait_published(a, snap)
        assert f"manifests/{snap}.json" in _objects(store_dir)
        assert not list((state.settings.state_dir / "snapshot-scratch").iterdir())


def test_store_settings(tmp_path: Path) -> None:
    from aenv.snapshots.repository import describe_store, s3_credentials

    s = Settings(state_dir=tmp_path)
    assert s.snapshot_store_url == f"file://{tmp_path / 'snapshot-store'}"
    assert Settings(state_dir=tmp_path, snapshot_store="").snapshot_store_url is None
    assert Settings(state_dir=tmp_path, snapshot_store="s3://b/p").snapshot_store_url == "s3://b/p"
    env = {"AWS_ACCESS_KEY_ID": "aws", "AWS_SECRET_ACCESS_KEY": "s1"}
    assert s3_credentials(env) == {"access_key_id": "aws", "secret_access_key": "s1"}
    env |= {"AENV_S3_ACCESS_KEY_ID": "mine", "AENV_S3_SECRET_ACCESS_KEY": "s2"}
    assert s3_credentials(env)["access_key_id"] == "mine"
    assert s3_credentials({}) == {}
    assert describe_store("s3://bucket/prefix") == "s3://bucket/prefix"
    from aenv.snapshots.repository import repository_from_settings

    repo = repository_from_settings(Settings(state_dir=tmp_path, snapshot_store="s3://bucket/pre"),
                                    {"AENV_S3_ACCESS_KEY_ID": "id", "AENV_S3_SECRET_ACCESS_KEY": "hidden"})
    assert repo is not None and "hidden" not in repr(repo.store) and repo.url == "s3://bucket/pre"
    assert repository_from_settings(Settings(state_dir=tmp_path, snapshot_store="")) is None
    # keys are not settings: nothing that dumps the settings can show them
    assert not any("key" in f and "s3" in f for f in Settings.model_fields)


def test_failed_publish_is_retried(tmp_path: Path, monkeypatch: Any) -> None:
    import aenv.core.sync as sync

    monkeypatch.setattr(sync, "PUBLISH_RETRY_DELAYS", (0.01, 0.01))
    with server(tmp_path, "a", f"file://{tmp_path / 'store'}") as (a, state):
        snapshots = state.orchestrator.sync
        real, calls = snapshots.publisher, []

        async def flaky(row: Any) -> None:
            calls.append(row.id)
            if len(calls) == 1:
                raise OSError("store away")
            await real(row)

        snapshots.publisher = flaky
        snap = _snapshot(a, _create(a))
        _wait_published(a, snap)
        assert calls == [snap, snap]

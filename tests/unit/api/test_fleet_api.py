"""Reaping by metadata (``/aenv/sandboxes/kill``) and the TTL counted from when a sandbox is ready."""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import time
from typing import Any
from urllib.parse import urlencode

import pytest
from starlette.testclient import TestClient

from tests.fixtures.runtime import FakeRuntime


def _create(client: TestClient, **body: object) -> str:
    resp = client.post("/v2/sandboxes", json={"templateID": "base", **body})
    assert resp.status_code == 201, resp.text
    return str(resp.json()["sandboxID"])


def _ids(client: TestClient) -> set[str]:
    return {s["sandboxID"] for s in client.get("/v2/sandboxes").json()}


def test_kill_by_metadata_ends_exactly_the_tagged(client: TestClient, runtime: FakeRuntime) -> None:
    run_a = {_create(client, metadata={"run": "A", "i": str(i)}) for i in range(5)}
    paused = _create(client, metadata={"run": "A"})
    assert client.post(f"/sandboxes/{paused}/pause", json={}).status_code == 204
    other = {_create(client, metadata={"run": "B"}), _create(client, metadata={"runner": "A"}), _create(client)}
    resp = client.post("/aenv/sandboxes/kill", json={"metadata": {"run": "A"}})
    assert resp.status_code == 200, resp.text
    assert set(resp.json()["killed"]) == run_a | {paused} and resp.json()["failed"] == []
    assert _ids(client) == other
    assert all(runtime.sandboxes.get(s) is None for s in run_a | {paused})
    # again: nothing left to kill; the DELETE form with the list route's encoding; all pairs must match
    assert client.post("/aenv/sandboxes/kill", json={"metadata": {"run": "A"}}).json()["killed"] == []
    resp = client.delete("/aenv/sandboxes", params={"metadata": urlencode({"run": "B", "x": "y"})})
    assert resp.status_code == 200 and resp.json()["killed"] == []
    resp = client.delete("/aenv/sandboxes", params={"metadata": urlencode({"run": "B"})})
    assert len(resp.json()["killed"]) == 1 and len(_ids(client)) == 2


@pytest.mark.parametrize("body,fragment", [
    ({"metadata": {}}, "metadata: give at least one"),
    ({}, "metadata"),
    ({"metadata": {"run": 5}}, "metadata.run"),
    ({"metadata": {"run": "A"}, "all": True}, "all"),
])
def test_kill_filter_bad_input_names_the_field(client: TestClient, body: dict[str, Any], fragment: str) -> None:
    keep = _create(client, metadata={"run": "A"})
    resp = client.post("/aenv/sandboxes/kill", json=body)
    assert resp.status_code == 400 and resp.json()["code"] == 400 and fragment in resp.json()["message"], resp.text
    assert client.delete("/aenv/sandboxes").status_code == 400
    assert keep in _ids(client)


def test_kill_waits_for_a_sandbox_still_starting(client: TestClient, runtime: FakeRuntime,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A create racing the reap cannot escape it: the starting sandbox is killed once it is up."""
    real = runtime.create

    async def slow(spec: Any) -> Any:
        await asyncio.sleep(0.5)
        return await real(spec)

    monkeypatch.setattr(runtime, "create", slow)
    created: list[str] = []
    t = threading.Thread(target=lambda: created.append(_create(client, metadata={"run": "R"})))
    t.start()
    try:
        deadline = time.monotonic() + 5
        while not len(client.app_state.orchestrator.table) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert runtime.calls == []  # it is still starting when the reap comes
        resp = client.post("/aenv/sandboxes/kill", json={"metadata": {"run": "R"}})
    finally:
        t.join()
    assert resp.json()["killed"] == created and _ids(client) == set()


def test_timeout_counts_from_ready(client: TestClient, runtime: FakeRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    real = runtime.create

    async def slow(spec: Any) -> Any:
        await asyncio.sleep(1.0)
        return await real(spec)

    monkeypatch.setattr(runtime, "create", slow)
    before = dt.datetime.now(dt.UTC)
    sid = _create(client, timeout=60)
    detail = client.get(f"/sandboxes/{sid}").json()
    started = dt.datetime.fromisoformat(detail["startedAt"].replace("Z", "+00:00"))
    end = dt.datetime.fromisoformat(detail["endAt"].replace("Z", "+00:00"))
    assert (started - before).total_seconds() >= 0.9  # startedAt is when it became usable
    assert (end - started).total_seconds() == pytest.approx(60, abs=0.01)

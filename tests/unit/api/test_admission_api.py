"""Burst admission through the control plane: a burst waits instead of failing, refusals are readable
429s ({"code", "message", "reason"} + Retry-After), per-key quotas, and idempotent retried creates."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from aenv.config import Settings
from tests.fixtures.runtime import FakeRuntime
from tests.unit.api.conftest import keyed_client


@pytest.fixture
def slow_starts(runtime: FakeRuntime, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Every create takes 50 ms; records the most that ran at once."""
    real = runtime.create
    seen = {"now": 0, "most": 0}

    async def slow(spec: Any) -> Any:
        seen["now"] += 1
        seen["most"] = max(seen["most"], seen["now"])
        try:
            await asyncio.sleep(0.05)
            return await real(spec)
        finally:
            seen["now"] -= 1

    monkeypatch.setattr(runtime, "create", slow)
    return seen


def _post(client: TestClient, headers: dict[str, str] | None = None, **body: Any) -> Any:
    return client.post("/v2/sandboxes", json={"templateID": "base", **body}, headers=headers or {})


def test_a_burst_waits_for_start_slots(client: TestClient, settings: Settings, slow_starts: dict[str, int]) -> None:
    settings.max_concurrent_starts = 3
    with ThreadPoolExecutor(24) as pool:
        answers = list(pool.map(lambda i: _post(client, metadata={"run": f"r{i % 3}"}), range(24)))
    assert [r.status_code for r in answers] == [201] * 24
    assert len({r.json()["sandboxID"] for r in answers}) == 24
    assert slow_starts["most"] == 3
    info = client.get("/aenv/info").json()
    assert info["starting"] == 0 and info["waiting"] == 0


def test_past_the_queue_a_readable_429(client: TestClient, settings: Settings, slow_starts: dict[str, int]) -> None:
    settings.max_concurrent_starts = 1
    settings.admission_queue = 2
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: _post(client), range(8)))
    refused = [r for r in answers if r.status_code != 201]
    assert refused and len(answers) - len(refused) >= 3
    for r in refused:
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        body = r.json()
        assert body["code"] == 429 and body["reason"] == "capacity" and "retry later" in body["message"]


def test_key_quota(settings: Settings, runtime: FakeRuntime, tmp_path: Path) -> None:
    """The older per-key setting: each key of api_keys is a team of its own, with that many sandboxes."""
    settings = settings.model_copy(update={"default_key_quota": 2, "api_keys": ["alice-key", "bob-key"]})
    with keyed_client(settings, runtime, tmp_path) as client:
        alice = {"X-API-KEY": "alice-key"}
        ids = [_post(client, alice).json()["sandboxID"] for _ in range(2)]
        over = _post(client, alice)
        body = over.json()
        assert over.status_code == 429 and body["reason"] == "quota" and body["quota"] == "max_sandboxes"
        assert body["limit"] == 2 and "max_sandboxes = 2" in body["message"]
        assert over.headers["retry-after"] == "5"
        assert _post(client, {"X-API-KEY": "bob-key"}).status_code == 201  # another key has its own
        assert client.delete(f"/sandboxes/{ids[0]}", headers=alice).status_code == 204
        assert _post(client, alice).status_code == 201


def test_node_full_is_capacity(client: TestClient, settings: Settings) -> None:
    settings.max_sandboxes = 1
    assert _post(client).status_code == 201
    full = _post(client)
    assert full.status_code == 429 and full.json()["reason"] == "capacity" and "limit of 1" in full.json()["message"]


def test_a_retried_create_with_one_idempotency_key_is_one_sandbox(
    client: TestClient, runtime: FakeRuntime, slow_starts: dict[str, int]
) -> None:
    key = {"Idempotency-Key": "rollout-17"}
    with ThreadPoolExecutor(5) as pool:  # the retries race the first create
        answers = list(pool.map(lambda _: _post(client, key, metadata={"run": "r"}), range(5)))
    assert {r.status_code for r in answers} == {201}
    assert len({r.json()["sandboxID"] for r in answers}) == 1
    again = _post(client, key)  # and a retry after it is up
    assert again.json()["sandboxID"] == answers[0].json()["sandboxID"]
    assert [c for c, _ in runtime.calls].count("create") == 1

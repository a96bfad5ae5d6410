"""Lifecycle options are honoured or refused, never ignored (issue 14, item 4), at the HTTP edge against a
fake runtime: unknown and unimplemented body fields are 400s that name them, timeout 0 expires now,
files-only pauses and cold resumes say what they kept, startedAfter includes its own instant."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.testclient import TestClient

from tests.fixtures.runtime import FakeRuntime


def _create(client: TestClient, **body: object) -> str:
    resp = client.post("/v2/sandboxes", json={"templateID": "base", **body})
    assert resp.status_code == 201, resp.text
    return str(resp.json()["sandboxID"])


def _refused(resp: Any, *fragments: str) -> None:
    assert resp.status_code == 400, resp.text
    body = resp.json()
    assert body["code"] == 400
    for fragment in fragments:
        assert fragment in body["message"], body["message"]


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"sandboxColor": "red"}, "sandboxColor"),
        ({"autoResume": {"enabled": False, "afterMs": 5}}, "autoResume.afterMs"),
        ({"mcp": {"github": {}}}, "mcp"),
        ({"iam": {"tokens": {"t": {"audience": "a", "tokenType": "jwt"}}}}, "iam"),
        ({"volumeMounts": [{"name": "v", "path": "/data", "subPath": "x"}]}, "volumeMounts[0].subPath"),
        # network rules aenv enforces are tests/unit/core/test_network.py's; these it cannot
        ({"network": {"rules": {"api.example.com": [{"transform": {"body": "x"}}]}}},
         "network.rules['api.example.com'][0].transform.body"),
        ({"network": {"rules": {"api.example.com": [{"transform": {"headers": {"X": "${e2b.secrets.nope}"}}}]}}},
         "secret 'nope' not found"),
        ({"network": {"egressProxy": {"address": "p:1080"}}}, "network.egressProxy"),
        ({"network": {"httpsPorts": [3000]}}, "network.httpsPorts"),
        ({"network": {"denyOut": ["example.com"]}}, "network.denyOut"),
        ({"network": {"allowOut": ["2001:db8::1"], "denyOut": ["0.0.0.0/0"]}}, "network.allowOut"),
        ({"network": {"allowOut": ["10.1.2.0/24"]}}, "network.allowOut"),
        ({"network": {"dnsServers": ["192.168.1.1"]}}, "network.dnsServers"),
        ({"network": {"denyOut": ["0.0.0.0/0"], "bandwidth": 1}}, "network.bandwidth"),
        ({"autoPauseMemory": False}, "autoPauseMemory"),
        ({"autoResume": {"enabled": True}}, "autoResume"),
        ({"autoPause": True, "autoPauseMemory": False, "autoResume": {"enabled": True}}, "autoPauseMemory"),
    ],
    ids=lambda v: str(v),
)
def test_create_refuses_what_aenv_does_not_do_by_name(
    client: TestClient, runtime: FakeRuntime, extra: dict[str, Any], named: str
) -> None:
    for path in ("/v2/sandboxes", "/sandboxes"):
        _refused(client.post(path, json={"templateID": "base", **extra}), named)
    assert runtime.calls == []  # nothing was started


def test_create_accepts_what_changes_nothing_or_is_done(client: TestClient, runtime: FakeRuntime) -> None:
    # what the SDKs send for options left unset, and network values that are today's behaviour
    sid = _create(client, network={"allowPublicTraffic": True, "allowOut": [], "denyOut": [], "rules": {}},
                  mcp=None, iam=None, volumeMounts=[], allow_internet_access=False, autoResume={"enabled": False})
    detail = client.get(f"/sandboxes/{sid}").json()
    assert detail["allowInternetAccess"] is False
    sid = _create(client, autoPause=True, autoPauseMemory=True, autoResume={"enabled": True})
    assert client.get(f"/sandboxes/{sid}").json()["lifecycle"] == {"autoResume": True, "onTimeout": "pause"}


def test_other_bodies_refuse_unknown_fields(client: TestClient) -> None:
    sid = _create(client)
    _refused(client.post(f"/sandboxes/{sid}/timeout", json={"timeout": 60, "extend": True}), "extend")
    _refused(client.post(f"/sandboxes/{sid}/pause", json={"snapshotName": "x"}), "snapshotName")
    _refused(client.post(f"/v2/sandboxes/{sid}/connect", json={"timeout": 60, "region": "eu"}), "region")
    _refused(client.post(f"/sandboxes/{sid}/connect", json={"timeout": 60, "region": "eu"}), "region")
    assert client.get(f"/sandboxes/{sid}").json()["state"] == "running"


def test_timeout_zero_expires_now(client: TestClient, runtime: FakeRuntime) -> None:
    killed = _create(client, timeout=600)
    assert client.post(f"/sandboxes/{killed}/timeout", json={"timeout": 0}).status_code == 204
    assert client.get(f"/sandboxes/{killed}").status_code == 404
    assert killed not in runtime.sandboxes
    paused = _create(client, timeout=600, autoPause=True, autoPauseMemory=False)
    assert client.post(f"/sandboxes/{paused}/timeout", json={"timeout": 0}).status_code == 204
    detail = client.get(f"/sandboxes/{paused}").json()
    assert detail["state"] == "paused" and detail["pauseMode"] == "filesystem"
    assert ("stop", paused) in runtime.calls
    _refused(client.post(f"/sandboxes/{_create(client)}/timeout", json={"timeout": -1}), "greater than 0")


def test_files_only_pause_and_cold_resume_say_what_they_kept(client: TestClient, runtime: FakeRuntime) -> None:
    sid = _create(client)
    first_boot = runtime.boot_ids[sid]
    assert client.post(f"/sandboxes/{sid}/pause", json={"memory": False}).status_code == 204
    assert client.get(f"/sandboxes/{sid}").json()["pauseMode"] == "filesystem"
    resp = client.post(f"/v2/sandboxes/{sid}/connect", json={})
    assert resp.status_code == 201
    assert "pauseMode" not in client.get(f"/sandboxes/{sid}").json()  # running: no pause to describe
    assert runtime.boot_ids[sid] != first_boot
    # a full pause, then a resume that discards the memory (on_resume="reboot")
    assert client.post(f"/sandboxes/{sid}/pause", json={}).status_code == 204
    assert client.get(f"/sandboxes/{sid}").json()["pauseMode"] == "full"
    second_boot = runtime.boot_ids[sid]
    assert client.post(f"/v2/sandboxes/{sid}/connect", json={"memory": False}).status_code == 201
    assert runtime.boot_ids[sid] != second_boot
    assert [c for c, s in runtime.calls if s == sid] == ["create", "stop", "boot", "pause", "boot"]
    # connect of a running sandbox resumes nothing, whatever memory says
    assert client.post(f"/v2/sandboxes/{sid}/connect", json={"memory": False}).status_code == 200


def test_a_pause_that_needs_envd_is_503_when_it_does_not_answer(client: TestClient, runtime: FakeRuntime) -> None:
    sid = _create(client)
    runtime.envd_answers = False
    for body in ({"memory": False}, {"requireHealthyGuest": True}):
        resp = client.post(f"/sandboxes/{sid}/pause", json=body)
        assert resp.status_code == 503 and resp.json()["code"] == 503, resp.text
        assert resp.headers.get("should-retry") == "false"
        assert client.get(f"/sandboxes/{sid}").json()["state"] == "running"
    assert client.post(f"/sandboxes/{sid}/pause", json={}).status_code == 204  # a plain pause does not ask


def test_expiry_pause_without_memory_keeps_it_when_envd_does_not_answer(
    client: TestClient, runtime: FakeRuntime
) -> None:
    sid = _create(client, timeout=600, autoPause=True, autoPauseMemory=False)
    runtime.envd_answers = False
    assert client.post(f"/sandboxes/{sid}/timeout", json={"timeout": 0}).status_code == 204
    detail = client.get(f"/sandboxes/{sid}").json()
    assert detail["state"] == "paused" and detail["pauseMode"] == "full"  # what it really kept


def test_started_after_includes_its_own_instant(client: TestClient) -> None:
    sid = _create(client)
    started = client.get(f"/sandboxes/{sid}").json()["startedAt"]
    listed = client.get("/v2/sandboxes", params={"startedAfter": started}).json()
    assert sid in [s["sandboxID"] for s in listed]
    later = started.replace(started[:4], str(int(started[:4]) + 1), 1)
    assert client.get("/v2/sandboxes", params={"startedAfter": later}).json() == []


def test_old_resume_route_sets_the_expiry_action(client: TestClient) -> None:
    sid = _create(client)
    client.post(f"/sandboxes/{sid}/pause", json={})
    resp = client.post(f"/sandboxes/{sid}/resume", json={"timeout": 60, "autoPause": True})
    assert resp.status_code == 201
    assert client.get(f"/sandboxes/{sid}").json()["lifecycle"]["onTimeout"] == "pause"

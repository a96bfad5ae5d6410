"""E2B control-plane shapes, lifecycle rules and error bodies (spec §2), against a fake runtime."""

from __future__ import annotations

import time
from urllib.parse import quote, urlencode

from starlette.testclient import TestClient

from tests.fixtures.runtime import FakeRuntime


def _create(client: TestClient, **body: object) -> dict:
    resp = client.post("/v2/sandboxes", json={"templateID": "base", **body})
    assert resp.status_code == 201, resp.text
    return resp.json()


def _assert_error(resp, status: int, fragment: str) -> None:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["code"] == status and isinstance(body["message"], str)
    assert fragment in body["message"]


def test_create_returns_sandbox_shape(client: TestClient) -> None:
    body = _create(client, timeout=60, metadata={"user": "alice"}, envVars={"A": "1"})
    assert body["templateID"] == "base"
    assert body["sandboxID"].isalnum() and body["sandboxID"].islower()
    assert len(body["envdAccessToken"]) == 64
    assert body["envdVersion"] and body["clientID"]
    detail = client.get(f"/sandboxes/{body['sandboxID']}").json()
    assert detail["state"] == "running" and detail["metadata"] == {"user": "alice"}
    assert detail["envdAccessToken"] == body["envdAccessToken"]
    assert detail["startedAt"].endswith("Z") and detail["endAt"] > detail["startedAt"]


def test_legacy_create_without_secure_has_no_token(client: TestClient) -> None:
    resp = client.post("/sandboxes", json={"templateID": "base", "timeout": 300})
    assert resp.status_code == 201
    assert "envdAccessToken" not in resp.json()


def test_bad_input_gets_e2b_errors(client: TestClient) -> None:
    _assert_error(client.post("/v2/sandboxes", json={"templateID": "nope"}), 404, "nope")
    _assert_error(client.post("/v2/sandboxes", json={"templateID": "base", "timeout": -5}), 400, "greater than 0")
    _assert_error(client.post("/v2/sandboxes", json={"templateID": "base", "timeout": 10**9}), 400, "cannot be greater")
    _assert_error(client.post("/v2/sandboxes", json={"templateID": "base", "timeout": "x"}), 400, "timeout")
    _assert_error(
        client.post("/v2/sandboxes", content=b"{not json", headers={"content-type": "application/json"}), 400, "invalid"
    )
    _assert_error(
        client.post("/v2/sandboxes", json={"templateID": "base", "metadata": {"k": "v" * 100_000}}), 400, "metadata too large"
    )
    _assert_error(client.post("/v2/sandboxes", json={"templateID": "base", "metadata": {"k": 5}}), 400, "metadata")
    _assert_error(client.get("/sandboxes/doesnotexist"), 404, "doesnotexist")
    _assert_error(client.delete("/sandboxes/doesnotexist"), 404, "doesnotexist")
    _assert_error(client.post("/sandboxes/doesnotexist/timeout", json={"timeout": 5}), 404, "doesnotexist")
    # The server keeps serving after all of that.
    assert client.get("/health").status_code == 200


def test_pause_connect_kill_lifecycle(client: TestClient, runtime: FakeRuntime) -> None:
    sid = _create(client)["sandboxID"]
    assert client.post(f"/sandboxes/{sid}/pause", json={}).status_code == 204
    assert client.get(f"/sandboxes/{sid}").json()["state"] == "paused"
    _assert_error(client.post(f"/sandboxes/{sid}/pause", json={}), 409, "paused")
    resp = client.post(f"/v2/sandboxes/{sid}/connect", json={"timeout": 120})
    assert resp.status_code == 201 and resp.json()["sandboxID"] == sid
    resp = client.post(f"/sandboxes/{sid}/connect", json={"timeout": 120})
    assert resp.status_code == 200
    assert client.delete(f"/sandboxes/{sid}").status_code == 204
    _assert_error(client.get(f"/sandboxes/{sid}"), 404, sid)
    assert [c for c, s in runtime.calls if s == sid] == ["create", "pause", "resume", "kill"]


def test_connect_extends_but_never_shortens(client: TestClient) -> None:
    sid = _create(client, timeout=1000)["sandboxID"]
    end_before = client.get(f"/sandboxes/{sid}").json()["endAt"]
    client.post(f"/v2/sandboxes/{sid}/connect", json={"timeout": 10})
    assert client.get(f"/sandboxes/{sid}").json()["endAt"] == end_before
    assert client.post(f"/sandboxes/{sid}/timeout", json={"timeout": 10}).status_code == 204
    assert client.get(f"/sandboxes/{sid}").json()["endAt"] < end_before


def test_list_filters_and_paginates(client: TestClient) -> None:
    ids = [_create(client, metadata={"user": "alice b", "k&=": "v/?"})["sandboxID"] for _ in range(3)]
    other = _create(client, metadata={"user": "bob"})["sandboxID"]
    client.post(f"/sandboxes/{ids[0]}/pause", json={})
    # The SDK's encoding: percent-encode key and value, form-encode, and the HTTP client encodes again.
    inner = urlencode({quote(k, safe=""): quote(v, safe="") for k, v in {"user": "alice b", "k&=": "v/?"}.items()})
    seen: list[str] = []
    token = None
    while True:
        params = {"metadata": inner, "limit": 1, **({"nextToken": token} if token else {})}
        resp = client.get("/v2/sandboxes", params=params)
        assert resp.status_code == 200
        seen += [s["sandboxID"] for s in resp.json()]
        token = resp.headers.get("x-next-token")
        if not token:
            break
    assert sorted(seen) == sorted(ids) and other not in seen
    running = client.get("/v2/sandboxes", params={"state": "running", "metadata": inner}).json()
    assert {s["sandboxID"] for s in running} == set(ids[1:])
    assert all(s["state"] == "running" for s in client.get("/sandboxes").json())
    _assert_error(client.get("/v2/sandboxes", params={"state": "dead"}), 400, "invalid state")
    _assert_error(client.get("/v2/sandboxes", params={"metadata": "a=b=c"}), 400, "metadata")


def test_metrics_shape(client: TestClient) -> None:
    sid = _create(client)["sandboxID"]
    samples = client.get(f"/sandboxes/{sid}/metrics").json()
    assert samples and set(samples[0]) >= {"timestamp", "timestampUnix", "cpuUsedPct", "memUsed", "memTotal", "diskUsed"}
    assert client.get(f"/sandboxes/{sid}/metrics", params={"start": int(time.time()) + 100}).json() == []


def test_record_of_a_held_sandbox_parses_as_the_clients_model_and_an_ended_one_is_unknown(client: TestClient) -> None:
    from e2b.api.client.models.sandbox_record import SandboxRecord

    sid = _create(client)["sandboxID"]
    got = client.get(f"/unstable/sandboxes/{sid}/record")
    assert got.status_code == 200, got.text
    rec = SandboxRecord.from_dict(got.json())
    assert rec.sandbox_id == sid and rec.template_id == got.json()["templateID"] and rec.cpu_count >= 1
    assert rec.stopped_at is None and not rec.retention_expired and not rec.events_retention_expired
    assert client.post(f"/sandboxes/{sid}/pause").status_code == 204
    assert client.get(f"/unstable/sandboxes/{sid}/record").json()["sandboxID"] == sid  # paused: still held
    assert client.delete(f"/sandboxes/{sid}").status_code == 204
    _assert_error(client.get(f"/unstable/sandboxes/{sid}/record"), 404, sid)
    _assert_error(client.get("/unstable/sandboxes/nope/record"), 404, "nope")


def test_reaper_kills_or_pauses_expired(client: TestClient, runtime: FakeRuntime) -> None:
    killed = _create(client, timeout=1)["sandboxID"]
    paused = _create(client, timeout=1, autoPause=True)["sandboxID"]
    deadline = time.time() + 10
    while time.time() < deadline:
        if client.get(f"/sandboxes/{killed}").status_code == 404 and (
            client.get(f"/sandboxes/{paused}").json().get("state") == "paused"
        ):
            break
        time.sleep(0.05)
    assert client.get(f"/sandboxes/{killed}").status_code == 404
    assert client.get(f"/sandboxes/{paused}").json()["state"] == "paused"
    assert killed not in runtime.sandboxes


def test_failed_create_leaves_nothing(client: TestClient, runtime: FakeRuntime) -> None:
    runtime.fail_create = True
    resp = client.post("/v2/sandboxes", json={"templateID": "base"})
    assert resp.status_code == 500 and resp.json()["code"] == 500
    assert client.get("/v2/sandboxes").json() == []


def test_proxy_unknown_sandbox_is_502_not_found(client: TestClient) -> None:
    resp = client.get("/health", headers={"E2b-Sandbox-Id": "nosuch", "E2b-Sandbox-Port": "49983"})
    assert resp.status_code == 502
    assert resp.json() == {"sandboxId": "nosuch", "message": "The sandbox was not found", "code": 502}
    resp = client.post("/init", headers={"E2b-Sandbox-Id": "nosuch"}, json={})
    assert resp.status_code == 403


def test_templates_routes(client: TestClient) -> None:
    items = client.get("/v2/templates").json()
    assert [t["templateID"] for t in items] == ["base"]
    assert client.get("/templates/aliases/base").json()["templateID"] == "base"
    _assert_error(client.get("/templates/nope"), 404, "nope")
    sid = _create(client)["sandboxID"]
    _assert_error(client.delete("/templates/base"), 409, "used")
    client.delete(f"/sandboxes/{sid}")
    assert client.delete("/templates/base").status_code == 204


def test_api_keys_enforced(settings, runtime, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from aenv.api.app import create_app

    settings.api_keys = ["e2b_" + "1" * 40]
    with TestClient(create_app(settings, runtime=runtime, ensure_base=False)) as c:
        _assert_error(c.get("/v2/sandboxes"), 401, "API key")
        _assert_error(c.get("/v2/sandboxes", headers={"X-API-KEY": "e2b_" + "2" * 40}), 401, "API key")
        assert c.get("/v2/sandboxes", headers={"X-API-KEY": "e2b_" + "1" * 40}).status_code == 200
        assert c.get("/health").status_code == 200


def test_bandwidth_is_an_aenv_create_option(client: TestClient, runtime: FakeRuntime) -> None:
    from aenv.runtime.shaping import Bandwidth

    r = client.post("/v2/sandboxes", json={"templateID": "base", "bandwidth": {"egressMbit": 5, "ingressMbit": 0}})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    assert runtime.bandwidth[sid] == Bandwidth(5.0, None)  # registered before the runtime made it
    assert client.get(f"/sandboxes/{sid}").json()["network"] == {"bandwidth": {"egressMbit": 5.0, "ingressMbit": 0.0}}
    child = client.post(f"/sandboxes/{sid}/fork", json={"count": 1}).json()[0]["sandbox"]["sandboxID"]
    assert runtime.bandwidth[child] == Bandwidth(5.0, None)  # the fork child keeps its parent's
    plain = client.post("/v2/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
    assert runtime.bandwidth[plain] is None  # the server's default
    _assert_error(client.post("/v2/sandboxes", json={"templateID": "base", "bandwidth": {"egressMbit": "5"}}), 400,
                  "egressMbit")
    _assert_error(client.post("/v2/sandboxes", json={"templateID": "base", "bandwidth": {"egressMbit": 0.001}}), 400,
                  "bandwidth.egressMbit")
    _assert_error(client.post("/v2/sandboxes", json={"templateID": "base", "bandwidth": {"upMbit": 1}}), 400,
                  "bandwidth.upMbit")

"""Ended sandboxes say why (404 for E2B clients, 410 when asked), and heartbeat leases end the sandboxes
of a client that stopped heartbeating (``core/leases.py``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from aenv.api.app import create_app
from aenv.api.proxy.routing import upstream_error
from aenv.config import Settings
from aenv.core.leases import LEASE_KEY
from aenv.errors import SandboxGone
from tests.fixtures.runtime import FakeRuntime

GONE_410 = {"Prefer": "aenv-gone=410"}


def _create(client: TestClient, **body: object) -> str:
    resp = client.post("/v2/sandboxes", json={"templateID": "base", **body})
    assert resp.status_code == 201, resp.text
    return str(resp.json()["sandboxID"])


def _wait(pred: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():  # type: ignore[operator]
            return
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def test_killed_sandbox_answers_why_404_then_410_when_asked(client: TestClient) -> None:
    sid = _create(client)
    assert client.delete(f"/sandboxes/{sid}").status_code == 204
    resp = client.get(f"/sandboxes/{sid}")
    assert resp.status_code == 404, resp.text  # what the E2B SDKs expect (NotFoundException)
    body = resp.json()
    assert body["code"] == 404 and body["reason"] == "killed" and "killed through the API" in body["message"]
    assert body["endedAt"].endswith("Z")
    resp = client.get(f"/sandboxes/{sid}", headers=GONE_410)
    assert resp.status_code == 410 and resp.json()["code"] == 410 and resp.headers["preference-applied"] == "aenv-gone=410"
    # every sandbox route says it, e.g. a second kill and a timeout change
    assert client.delete(f"/sandboxes/{sid}", headers=GONE_410).status_code == 410
    assert client.post(f"/sandboxes/{sid}/timeout", json={"timeout": 30}).json()["reason"] == "killed"
    # an ID that never existed stays a plain 404, asked or not
    resp = client.get("/sandboxes/nosuchsandbox00000000", headers=GONE_410)
    assert resp.status_code == 404 and "reason" not in resp.json()


def test_expired_and_reaped_sandboxes_have_their_own_reason(client: TestClient) -> None:
    expiring = _create(client, timeout=1)
    reaped = _create(client, metadata={"run": "r7"})
    assert client.post("/aenv/sandboxes/kill", json={"metadata": {"run": "r7"}}).json()["killed"] == [reaped]
    _wait(lambda: client.get(f"/sandboxes/{expiring}").status_code == 404)
    assert client.get(f"/sandboxes/{expiring}").json()["reason"] == "expired"
    body = client.get(f"/sandboxes/{reaped}").json()
    assert body["reason"] == "reaped" and "run=r7" in body["message"]


def test_proxy_names_the_reason_in_its_502() -> None:
    status, raw = upstream_error("abc", SandboxGone("abc", "expired", "its timeout ran out", "2026-12-02T03:00:00Z"))
    body = json.loads(raw)
    assert status == 502 and body["code"] == 502 and body["reason"] == "expired"
    assert body["message"] == "The sandbox was not found"  # E2B's words exactly: the JS SDK's tests compare them
    assert "its timeout ran out" in body["detail"] and body["endedAt"] == "2026-12-02T03:00:00Z"


def test_tombstone_survives_a_restart(settings: Settings, runtime: FakeRuntime, tmp_path: Path) -> None:
    def serve() -> TestClient:
        app = create_app(settings, runtime=runtime, ensure_base=False)  # type: ignore[arg-type]
        return TestClient(app)

    with serve() as c:
        c.app.app.state.catalog.register(alias="base", kind="bootstrap", rootfs=tmp_path / "rootfs", template_id="base")  # type: ignore[attr-defined]
        sid = _create(c)
        c.delete(f"/sandboxes/{sid}")
    with serve() as c:
        assert c.get(f"/sandboxes/{sid}").json()["reason"] == "killed"


def _lease(client: TestClient, ttl: float, name: str = "") -> str:
    resp = client.post("/aenv/leases", json={"ttl": ttl, "name": name})
    assert resp.status_code == 201, resp.text
    assert resp.json()["state"] == "live" and resp.json()["ttl"] == ttl
    return str(resp.json()["leaseID"])


def test_lease_without_heartbeat_kills_exactly_its_sandboxes(client: TestClient, runtime: FakeRuntime) -> None:
    lease = _lease(client, 1.0, "run7")
    bound = {_create(client, metadata={LEASE_KEY: lease}) for _ in range(3)}
    other = _create(client)
    assert client.get(f"/aenv/leases/{lease}").json()["sandboxes"] == 3
    _wait(lambda: client.get(f"/aenv/leases/{lease}").json()["state"] == "ended")
    _wait(lambda: all(runtime.sandboxes.get(s) is None for s in bound))
    for sid in bound:
        body = client.get(f"/sandboxes/{sid}").json()
        assert body["reason"] == "lease_expired" and lease in body["message"]
    assert client.get(f"/sandboxes/{other}").status_code == 200
    # an ended lease: heartbeat is a 410; new sandboxes cannot join it
    resp = client.post(f"/aenv/leases/{lease}/heartbeat")
    assert resp.status_code == 410 and "no heartbeat" in resp.json()["message"]
    resp = client.post("/v2/sandboxes", json={"templateID": "base", "metadata": {LEASE_KEY: lease}})
    assert resp.status_code == 410, resp.text


def test_heartbeat_keeps_sandboxes_past_the_lease_ttl(client: TestClient) -> None:
    lease = _lease(client, 1.0)
    sid = _create(client, metadata={LEASE_KEY: lease})
    end = time.monotonic() + 2.5
    while time.monotonic() < end:  # 2.5 ttl's worth of heartbeats
        resp = client.post(f"/aenv/leases/{lease}/heartbeat")
        assert resp.status_code == 200 and resp.json()["state"] == "live", resp.text
        time.sleep(0.15)
    assert client.get(f"/sandboxes/{sid}").status_code == 200


def test_delete_ends_the_lease_and_reports_the_kills(client: TestClient) -> None:
    lease = _lease(client, 60)
    bound = {_create(client, metadata={LEASE_KEY: lease, "i": str(i)}) for i in range(2)}
    resp = client.delete(f"/aenv/leases/{lease}")
    assert resp.status_code == 200 and set(resp.json()["killed"]) == bound, resp.text
    assert all(client.get(f"/sandboxes/{s}").json()["reason"] == "lease_ended" for s in bound)
    assert [entry["state"] for entry in client.get("/aenv/leases").json()] == ["ended"]
    assert client.delete(f"/aenv/leases/{lease}").status_code == 410


@pytest.mark.parametrize("body,status,fragment", [
    ({"ttl": 0}, 400, "ttl"),
    ({"ttl": 10**9}, 400, "ttl"),
    ({"ttl": "soon"}, 400, "ttl"),
    ({"ttl": 5, "color": "red"}, 400, "color"),
])
def test_lease_bad_input_names_the_field(client: TestClient, body: dict[str, object], status: int, fragment: str) -> None:
    resp = client.post("/aenv/leases", json=body)
    assert resp.status_code == status and fragment in resp.json()["message"], resp.text


def test_unknown_lease_is_refused_at_create(client: TestClient) -> None:
    resp = client.post("/v2/sandboxes", json={"templateID": "base", "metadata": {LEASE_KEY: "nosuchlease"}})
    assert resp.status_code == 400 and LEASE_KEY in resp.json()["message"], resp.text
    assert resp.json()["reason"] == "lease_unknown"  # a gateway tries another node on it
    assert client.get("/aenv/leases/nosuchlease").status_code == 404
    assert client.post("/aenv/leases/nosuchlease/heartbeat").status_code == 404


def test_a_create_racing_the_lease_end_is_killed(client: TestClient, runtime: FakeRuntime) -> None:
    """The binding check passed, then the lease ended before the sandbox was in the table: the created
    event kills it."""
    lease = _lease(client, 60)
    leases = client.app_state.leases  # type: ignore[attr-defined]
    check = leases.check_binding
    leases.check_binding = lambda meta, owner: (check(meta, owner), leases.log.update(
        lease, ended_at=time.time(), end_reason="expired"))
    sid = _create(client, metadata={LEASE_KEY: lease})
    _wait(lambda: runtime.sandboxes.get(sid) is None)
    assert client.get(f"/sandboxes/{sid}").json()["reason"] == "lease_expired"


def test_lease_gets_a_full_ttl_after_a_restart(settings: Settings, runtime: FakeRuntime, tmp_path: Path) -> None:
    settings = settings.model_copy(update={"reaper_interval": 0.05})
    app = create_app(settings, runtime=runtime, ensure_base=False)  # type: ignore[arg-type]
    with TestClient(app) as c:
        lease = _lease(c, 1.0)
    time.sleep(1.2)  # down for longer than its ttl
    app = create_app(settings, runtime=runtime, ensure_base=False)  # type: ignore[arg-type]
    with TestClient(app) as c:
        assert c.post(f"/aenv/leases/{lease}/heartbeat").status_code == 200


def test_metrics_count_events_and_refusals_by_run(client: TestClient, settings: Settings) -> None:
    a = _create(client, metadata={"run": 'r"7'})  # a quote in the label is escaped
    _create(client, metadata={"run": "r8"})
    client.delete(f"/sandboxes/{a}")
    client.app_state.settings.max_sandboxes = 1  # type: ignore[attr-defined]
    assert client.post("/v2/sandboxes", json={"templateID": "base", "metadata": {"run": "r9"}}).status_code == 429
    text = client.get("/metrics").text
    assert 'aenv_run_events_total{run="r\\"7",event="created"} 1' in text
    assert 'aenv_run_events_total{run="r\\"7",event="killed"} 1' in text
    assert 'aenv_run_sandboxes{run="r8",state="running"} 1' in text
    assert 'aenv_run_creates_refused_total{run="r9",reason="capacity"} 1' in text
    assert 'aenv_run_sandboxes{run="r\\"7"' not in text


def test_a_gateway_names_the_lease_it_makes_on_every_node(client: TestClient) -> None:
    """``X-Aenv-Lease-Id``: the same lease ID on each node; taken twice is a 409, a bad one a 400."""
    made = client.post("/aenv/leases", json={"ttl": 30}, headers={"X-Aenv-Lease-Id": "gwlease0000000000001"})
    assert made.status_code == 201 and made.json()["leaseID"] == "gwlease0000000000001", made.text
    sid = _create(client, metadata={LEASE_KEY: "gwlease0000000000001"})
    assert client.get("/aenv/leases/gwlease0000000000001").json()["sandboxes"] == 1 and sid
    again = client.post("/aenv/leases", json={"ttl": 30}, headers={"X-Aenv-Lease-Id": "gwlease0000000000001"})
    assert again.status_code == 409, again.text
    bad = client.post("/aenv/leases", json={"ttl": 30}, headers={"X-Aenv-Lease-Id": "../x"})
    assert bad.status_code == 400 and "lease id" in bad.json()["message"], bad.text

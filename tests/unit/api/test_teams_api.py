"""Teams at the HTTP edge (fake runtime): every route of the route table, tried by one team with another
team's IDs, answers exactly what it answers for an unknown ID; lists never show another team's objects;
an admin key sees and acts on all; quotas refuse with their name and value.

The route table is read from the app itself: a route added later without an entry in ``BODIES`` fails
``test_every_route_is_covered``, so no route escapes the check by being new.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from aenv.config import Settings
from aenv.teams import Quota, TeamSpec
from tests.fixtures.runtime import FakeRuntime
from tests.unit.api.conftest import keyed_client
from tests.unit.api.test_volumes_api import MountingRuntime

ALICE = {"X-API-KEY": "alice-key"}
BOB = {"X-API-KEY": "bob-key"}
ROOT = {"X-API-KEY": "root-key"}
HASH = "ab" * 32

# Routes left out, and why: they are not behind API keys (their own token or none), or serve the docs.
UNKEYED = {
    "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc", "/health", "/metrics",
    "/aenv/build-files/{files_hash}",  # an HMAC upload link, per files hash
}
# the volume's own token (Authorization: Bearer), checked per volume; the console's page, files and login
UNKEYED_PREFIX = ("/volumecontent/", "/console")

# A valid body for every keyed route that takes one (so an unknown ID gets as far as the route itself).
BODIES: dict[tuple[str, str], Any] = {
    ("PUT", "/sandboxes/{sandbox_id}/network"): {"allowOut": ["10.1.2.3"]},
    ("POST", "/sandboxes/{sandbox_id}/timeout"): {"timeout": 60},
    ("POST", "/sandboxes/{sandbox_id}/refreshes"): {},
    ("POST", "/sandboxes/{sandbox_id}/pause"): {},
    ("POST", "/v2/sandboxes/{sandbox_id}/connect"): {"timeout": 60},
    ("POST", "/sandboxes/{sandbox_id}/connect"): {"timeout": 60},
    ("POST", "/sandboxes/{sandbox_id}/resume"): {},
    ("POST", "/sandboxes/{sandbox_id}/snapshots"): {},
    ("POST", "/sandboxes/{sandbox_id}/fork"): {"count": 1},
    ("POST", "/sandboxes/{sandbox_id}/rollback"): {"snapshotID": "{snapshot_id}"},
    ("POST", "/aenv/sandboxes/{sandbox_id}/adopt"): {},
    ("PATCH", "/v2/templates/{template_id}"): {"public": True},
    ("PATCH", "/templates/{template_id}"): {"public": True},
    ("POST", "/v2/templates/{template_id}/builds/{build_id}"): {"fromTemplate": "base", "steps": []},
    ("POST", "/secrets/{secret_id}"): {"name": "n", "value": "v"},
}

# Query parameters a route requires.
QUERIES: dict[tuple[str, str], dict[str, str]] = {
    ("GET", "/templates/{template_id}/tags/exists"): {"tag": "default"},
}


def _routes(client: TestClient) -> list[tuple[str, str]]:
    app: Any = client.app
    while not hasattr(app, "routes"):
        app = getattr(app, "app", None) or app.api
    out: list[tuple[str, str]] = []

    def walk(routes: Any) -> None:
        for r in routes:
            if hasattr(r, "path"):
                out.extend((m, r.path) for m in sorted(getattr(r, "methods", None) or ()) if m != "HEAD")
            else:
                walk(r.original_router.routes)

    walk(app.routes)
    return out


@pytest.fixture
def teams(settings: Settings, tmp_path: Path) -> Iterator[TestClient]:
    configured = settings.model_copy(update={
        "teams": {"alice": TeamSpec(keys=["alice-key"]), "bob": TeamSpec(keys=["bob-key"])},
        "admin_keys": ["root-key"],
    })
    with keyed_client(configured, MountingRuntime(), tmp_path) as client:
        yield client


def _alices_objects(client: TestClient) -> dict[str, str]:
    """One of each kind of object, made by alice: path parameter -> ID."""
    sid = client.post("/v2/sandboxes", json={"templateID": "base"}, headers=ALICE).json()["sandboxID"]
    snap = client.post(f"/sandboxes/{sid}/snapshots", json={"name": "alice-snap"}, headers=ALICE).json()["snapshotID"]
    vol = client.post("/volumes", json={"name": "alice-vol"}, headers=ALICE).json()["volumeID"]
    lease = client.post("/aenv/leases", json={"ttl": 600}, headers=ALICE).json()["leaseID"]
    build = client.post("/v3/templates", json={"name": "alice-tpl"}, headers=ALICE).json()
    return {"sandbox_id": sid, "snapshot_id": snap, "template_id": snap, "volume_id": vol, "lease_id": lease,
            "build_id": build["buildID"], "alias": "alice-snap", "template": snap, "files_hash": HASH,
            "tag": "default", "secret_id": str(uuid.uuid4())}  # fmt: skip


def _unknown_like(ids: dict[str, str]) -> dict[str, str]:
    fresh = {k: ("u" + uuid.uuid4().hex[: max(1, len(v) - 1)]) for k, v in ids.items()}
    fresh.update(build_id=str(uuid.uuid4()), files_hash=HASH, tag="default", secret_id=ids["secret_id"])
    return fresh


def _fill(text: str, ids: dict[str, str]) -> str:
    return re.sub(r"{(\w+)(?::path)?}", lambda m: ids[m.group(1)], text)


def _call(client: TestClient, method: str, path: str, ids: dict[str, str], who: dict[str, str]) -> tuple[int, str]:
    body = BODIES.get((method, path))
    if isinstance(body, dict):
        body = {k: _fill(v, ids) if isinstance(v, str) else v for k, v in body.items()}
    r = client.request(method, _fill(path, ids), json=body, headers=who, params=QUERIES.get((method, path)))
    text = r.text
    for v in ids.values():
        text = text.replace(v, "<id>")
    return r.status_code, text


def test_every_route_is_covered(teams: TestClient) -> None:
    for method, path in _routes(teams):
        if path in UNKEYED or path.startswith(UNKEYED_PREFIX) or "{" not in path:
            continue
        takes_body = method in ("PUT", "PATCH") or (method == "POST" and not path.endswith(("/heartbeat", "/pin/{template}")))
        if takes_body:
            assert (method, path) in BODIES, f"{method} {path}: give it a valid body in BODIES"


def test_another_teams_ids_answer_as_unknown_ids_on_every_route(teams: TestClient) -> None:
    ids = _alices_objects(teams)
    checked = 0
    for method, path in _routes(teams):
        if path in UNKEYED or path.startswith(UNKEYED_PREFIX) or "{" not in path:
            continue
        theirs = _call(teams, method, path, ids, BOB)
        unknown = _call(teams, method, path, _unknown_like(ids), BOB)
        assert theirs == unknown, f"{method} {path}: alice's IDs {theirs} but unknown IDs {unknown}"
        checked += 1
    assert checked >= 40
    # nothing bob tried touched alice's objects
    assert teams.get(f"/sandboxes/{ids['sandbox_id']}", headers=ALICE).json()["state"] == "running"
    assert teams.get(f"/snapshots/{ids['snapshot_id']}", headers=ALICE).status_code == 200
    assert teams.get(f"/volumes/{ids['volume_id']}", headers=ALICE).status_code == 200
    assert teams.get(f"/aenv/leases/{ids['lease_id']}", headers=ALICE).json()["state"] == "live"


def test_lists_show_a_teams_own_and_an_admin_sees_all(teams: TestClient) -> None:
    ids = _alices_objects(teams)
    bobs = teams.post("/v2/sandboxes", json={"templateID": "base", "metadata": {"run": "r1"}}, headers=BOB).json()
    for path in ("/v2/sandboxes", "/sandboxes", "/snapshots", "/volumes", "/aenv/leases", "/templates"):
        seen = teams.get(path, headers=BOB).text
        assert all(v not in seen for k, v in ids.items() if k in ("sandbox_id", "snapshot_id", "volume_id", "lease_id")), path
    assert {s["sandboxID"] for s in teams.get("/v2/sandboxes", headers=BOB).json()} == {bobs["sandboxID"]}
    assert "base" in teams.get("/templates", headers=BOB).text  # the server's own templates are every team's
    everyone = {s["sandboxID"] for s in teams.get("/v2/sandboxes", headers=ROOT).json()}
    assert everyone == {ids["sandbox_id"], bobs["sandboxID"]}
    assert teams.get(f"/snapshots/{ids['snapshot_id']}", headers=ROOT).status_code == 200
    # batch metrics leaves another team's sandbox out, as it does an unknown one
    got = teams.get("/sandboxes/metrics", params={"sandbox_ids": f"{ids['sandbox_id']},{bobs['sandboxID']}"}, headers=BOB)
    assert ids["sandbox_id"] not in got.text
    # killing a run reaches the team's own sandboxes only
    teams.post("/v2/sandboxes", json={"templateID": "base", "metadata": {"run": "r1"}}, headers=ALICE)
    killed = teams.post("/aenv/sandboxes/kill", json={"metadata": {"run": "r1"}}, headers=BOB).json()["killed"]
    assert killed == [bobs["sandboxID"]]
    assert len(teams.get("/v2/sandboxes", params={"metadata": "run=r1"}, headers=ALICE).json()) == 1
    # an admin acts on any team's sandbox
    assert teams.delete(f"/sandboxes/{ids['sandbox_id']}", headers=ROOT).status_code == 204


def test_templates_private_until_published(teams: TestClient) -> None:
    ids = _alices_objects(teams)
    snap = ids["snapshot_id"]
    refused = teams.post("/v2/sandboxes", json={"templateID": "alice-snap"}, headers=BOB)
    assert refused.status_code == 404 and refused.json()["code"] == 404
    assert teams.get("/templates/aliases/alice-snap", headers=BOB).status_code == 404
    assert teams.post("/v2/sandboxes", json={"templateID": "alice-snap"}, headers=ROOT).status_code == 201  # admin
    build = teams.post("/v3/templates", json={"name": "bobs"}, headers=BOB).json()  # a build FROM alice's: unknown
    started = teams.post(f"/v2/templates/{build['templateID']}/builds/{build['buildID']}",
                         json={"fromTemplate": "alice-snap", "steps": []}, headers=BOB)  # fmt: skip
    assert started.status_code == 202
    for _ in range(200):
        status = teams.get(f"/templates/{build['templateID']}/builds/{build['buildID']}/status", headers=BOB).json()
        if status["status"] in ("ready", "error"):
            break
        time.sleep(0.02)
    assert status["status"] == "error" and "alice-snap" in str(status) and snap not in str(status), status
    assert teams.patch(f"/v2/templates/{snap}", json={"public": True}, headers=BOB).status_code == 404
    assert teams.patch(f"/v2/templates/{snap}", json={"public": True}, headers=ALICE).status_code == 200
    assert teams.get("/templates/aliases/alice-snap", headers=BOB).json() == {"templateID": snap, "public": True}
    from_public = teams.post("/v2/sandboxes", json={"templateID": "alice-snap"}, headers=BOB)
    assert from_public.status_code == 201
    bobs_child = teams.post(f"/sandboxes/{from_public.json()['sandboxID']}/snapshots", json={}, headers=BOB).json()
    tree = teams.get(f"/snapshots/{snap}", headers=ALICE).json()
    assert bobs_child["snapshotID"] not in str(tree)  # alice's tree does not show bob's snapshot of it
    assert bobs_child["snapshotID"] in str(teams.get(f"/snapshots/{snap}", headers=ROOT).json())
    assert teams.delete(f"/templates/{snap}", headers=BOB).status_code == 404  # published is not bob's to delete
    # a name is one team's: another team cannot build over it or take it for its snapshot
    assert teams.post("/v3/templates", json={"name": "alice-tpl"}, headers=BOB).status_code == 409
    bobs = teams.post("/v2/sandboxes", json={"templateID": "base"}, headers=BOB).json()["sandboxID"]
    taken = teams.post(f"/sandboxes/{bobs}/snapshots", json={"name": "alice-snap"}, headers=BOB)
    assert taken.status_code == 409 and "another team" in taken.json()["message"]


def test_operator_routes_need_an_admin_key(teams: TestClient) -> None:
    for path in ("/aenv/cache", "/aenv/webhooks", "/aenv/webhooks/deliveries"):
        r = teams.get(path, headers=BOB)
        assert r.status_code == 403 and "admin_keys" in r.json()["message"]
        assert teams.get(path, headers=ROOT).status_code == 200
    assert teams.get("/v2/sandboxes", headers={"X-API-KEY": "wrong"}).status_code == 401


def test_quotas_refuse_with_their_name_and_value(settings: Settings, tmp_path: Path) -> None:
    configured = settings.model_copy(update={
        "teams": {"small": TeamSpec(keys=["s"], max_sandboxes=2, max_vcpus=3), "big": TeamSpec(keys=["b"])},
        "team_quota": Quota(max_memory_mb=100_000),
    })
    with keyed_client(configured, FakeRuntime(), tmp_path) as client:
        small = {"X-API-KEY": "s"}
        first = client.post("/v2/sandboxes", json={"templateID": "base", "cpuCount": 2}, headers=small)
        assert first.status_code == 201
        over_cpu = client.post("/v2/sandboxes", json={"templateID": "base", "cpuCount": 2}, headers=small)
        assert over_cpu.status_code == 429 and over_cpu.json()["quota"] == "max_vcpus" and over_cpu.json()["limit"] == 3
        alone = client.post("/v2/sandboxes", json={"templateID": "base", "cpuCount": 4}, headers=small)
        assert alone.status_code == 403 and alone.json()["reason"] == "quota" and "alone" in alone.json()["message"]
        assert client.post("/v2/sandboxes", json={"templateID": "base", "cpuCount": 1}, headers=small).status_code == 201
        count = client.post("/v2/sandboxes", json={"templateID": "base", "cpuCount": 1}, headers=small)
        assert count.status_code == 429 and count.json()["quota"] == "max_sandboxes"
        fork = client.post(f"/sandboxes/{first.json()['sandboxID']}/fork", json={"count": 1}, headers=small)
        assert fork.status_code == 429 and fork.json()["quota"] == "max_sandboxes"  # forks count too
        assert client.post("/v2/sandboxes", json={"templateID": "base"}, headers={"X-API-KEY": "b"}).status_code == 201
        shown = {t["team"]: t for t in client.get("/aenv/teams", headers=small).json()}
        assert list(shown) == ["small"] and shown["small"]["usage"]["sandboxes"] == 2
        assert shown["small"]["quota"]["max_memory_mb"] == 100_000  # the default fills what a team leaves unset
        metrics = client.get("/metrics").text
        assert 'aenv_team_sandboxes{team="small"} 2' in metrics and 'aenv_team_quota{team="small",quota="max_vcpus"} 3' in metrics
        assert 'aenv_team_refusals_total{team="small",quota="max_sandboxes"} 2' in metrics


def test_disk_quota_counts_what_a_team_keeps(settings: Settings, tmp_path: Path) -> None:
    configured = settings.model_copy(update={
        "teams": {"small": TeamSpec(keys=["s"], max_disk_mb=1), "big": TeamSpec(keys=["b"])},
    })
    with keyed_client(configured, MountingRuntime(), tmp_path) as client:
        small = {"X-API-KEY": "s"}
        vol = client.post("/volumes", json={"name": "data"}, headers=small).json()["volumeID"]
        (configured.volumes_dir / vol / "blob").write_bytes(b"x" * (2 << 20))  # 2 MiB kept
        over = client.post("/volumes", json={"name": "more"}, headers=small)
        assert over.status_code == 429 and over.json()["quota"] == "max_disk_mb" and over.json()["limit"] == 1
        sid = client.post("/v2/sandboxes", json={"templateID": "base"}, headers=small).json()["sandboxID"]
        snap = client.post(f"/sandboxes/{sid}/snapshots", json={}, headers=small)
        assert snap.status_code == 429 and snap.json()["quota"] == "max_disk_mb"
        assert client.post("/v3/templates", json={"name": "t"}, headers=small).status_code == 429
        assert client.post("/volumes", json={"name": "data"}, headers={"X-API-KEY": "b"}).status_code == 201
        assert client.delete(f"/volumes/{vol}", headers=small).status_code == 204
        assert client.post("/volumes", json={"name": "more"}, headers=small).status_code == 201

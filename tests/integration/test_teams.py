"""Two teams and an admin on real servers, through the unmodified E2B SDK and the REST API: on one node
directly, and through ``aenv gateway`` in front of two nodes (ns).

Alice's sandboxes, snapshots, volumes and leases are unknown IDs to Bob (the SDK's own NotFound errors,
the REST API's 404 with the unknown-ID message), lists never show them, Bob's quota refuses with its
name and value, and the admin key sees and acts on both. The full route table is walked against the same
code at the edge in ``tests/unit/api/test_teams_api.py``; here the real processes, the SDK and the gateway's
merging and lookups are what is tested.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import NotFoundException, Sandbox, SandboxException

from aenv.testing.gateway import NodeCluster, start_gateway
from aenv.testing.server import API_KEY

pytestmark = pytest.mark.timeout(600)  # ns: its own servers (not the SDK pass on vm)

ALICE, BOB = "alice-key-" + "a" * 20, "bob-key-" + "b" * 20
TEAMS = {"alice": {"keys": [ALICE]}, "bob": {"keys": [BOB], "max_sandboxes": 2}}
ENV = {"AENV_TEAMS": json.dumps(TEAMS), "AENV_ADMIN_KEYS": API_KEY, "AENV_POOL_SIZE": "1"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeCluster]:
    if os.geteuid() != 0:
        pytest.skip("the ns runtime needs root")
    c = NodeCluster(tmp_path_factory.mktemp("teams"), 2, ENV, runtime="ns")  # teams live above the runtime
    try:
        c.start_node(0)
        c.start_node(1)
        c.gateway = start_gateway(c.tmp, [c.url(0), c.url(1)], ENV)
        yield c
    finally:
        c.close()


def _sdk(url: str) -> dict[str, str]:
    return {"api_url": url, "sandbox_url": url}


def _get(url: str, path: str, key: str) -> httpx.Response:
    return httpx.get(url + path, headers={"X-API-KEY": key}, trust_env=False, timeout=30)


def _unknown_answer(url: str, path_of: str) -> tuple[int, str]:
    """What ``path_of`` (with ``{}`` for the ID) answers Bob for an ID nobody has."""
    fake = "i" + uuid.uuid4().hex[:19]
    r = _get(url, path_of.format(fake), BOB)
    return r.status_code, r.text.replace(fake, "<id>")


@pytest.mark.parametrize("through", ["node", "gateway"])
def test_two_teams_and_an_admin(cluster: NodeCluster, through: str) -> None:
    url = cluster.url(0) if through == "node" else cluster.gw
    alice = Sandbox.create("base", api_key=ALICE, metadata={"run": "shared-name"}, **_sdk(url))
    try:
        assert alice.commands.run("echo hi").stdout.strip() == "hi"
        sid = alice.sandbox_id
        # Bob: the SDK's own "not found" for every kind of call
        with pytest.raises(NotFoundException):
            Sandbox.connect(sid, api_key=BOB, **_sdk(url))
        assert Sandbox.kill(sid, api_key=BOB, **_sdk(url)) is False
        with pytest.raises(NotFoundException):
            Sandbox.set_timeout(sid, 30, api_key=BOB, **_sdk(url))
        assert sid not in {s.sandbox_id for s in Sandbox.list(api_key=BOB, **_sdk(url)).next_items()}
        # the REST answers are the unknown ID's, byte for byte (the ID aside)
        for path in ("/sandboxes/{}", "/sandboxes/{}/logs", "/sandboxes/{}/metrics"):
            r = _get(url, path.format(sid), BOB)
            assert (r.status_code, r.text.replace(sid, "<id>")) == _unknown_answer(url, path), path
        snap = httpx.post(f"{url}/sandboxes/{sid}/snapshots", json={"name": f"alice-{through}"},
                          headers={"X-API-KEY": ALICE}, trust_env=False, timeout=120).json()  # fmt: skip
        r = _get(url, f"/snapshots/{snap['snapshotID']}", BOB)
        assert (r.status_code, r.text.replace(snap["snapshotID"], "<id>")) == _unknown_answer(url, "/snapshots/{}")
        assert snap["snapshotID"] not in _get(url, "/snapshots", BOB).text
        with pytest.raises(SandboxException, match=f"404: template 'alice-{through}' not found"):
            Sandbox.create(f"alice-{through}", api_key=BOB, **_sdk(url))  # a private template: as if none
        # the admin sees and acts on both teams
        bob = Sandbox.create("base", api_key=BOB, **_sdk(url))
        listed = {s.sandbox_id for s in Sandbox.list(api_key=API_KEY, **_sdk(url)).next_items()}
        assert {sid, bob.sandbox_id} <= listed
        assert Sandbox.connect(sid, api_key=API_KEY, **_sdk(url)).commands.run("echo admin").stdout.strip() == "admin"
        # Bob's quota: 2 sandboxes; the third is a 429 naming it
        second = Sandbox.create("base", api_key=BOB, **_sdk(url))
        over = httpx.post(f"{url}/v2/sandboxes", json={"templateID": "base"}, headers={"X-API-KEY": BOB},
                          trust_env=False, timeout=60)  # fmt: skip
        assert over.status_code == 429, over.text
        assert over.json()["reason"] == "quota" and over.json()["quota"] == "max_sandboxes" and over.json()["limit"] == 2
        # a run's reaping reaches the team's own sandboxes only
        reaped = httpx.post(f"{url}/aenv/sandboxes/kill", json={"metadata": {"run": "shared-name"}},
                            headers={"X-API-KEY": BOB}, trust_env=False, timeout=60).json()  # fmt: skip
        assert reaped["killed"] == []
        assert alice.is_running()
        # the CLI shows each key its own team, and the admin every team
        shown = json.loads(subprocess.run([sys.executable, "-m", "aenv.cli.main", "teams", "-o", "json", "--server", url,
                                           "--api-key", BOB], capture_output=True, text=True, check=True).stdout)
        assert [t["team"] for t in shown] == ["bob"] and shown[0]["usage"]["sandboxes"] >= 1
        assert shown[0]["quota"]["max_sandboxes"] == 2 and shown[0]["refused"].get("max_sandboxes", 0) >= 0
        assert Sandbox.kill(bob.sandbox_id, api_key=API_KEY, **_sdk(url)) is True
        second.kill()
    finally:
        alice.kill()


def test_leases_and_volumes_are_a_teams_own(cluster: NodeCluster) -> None:
    url = cluster.gw
    lease = httpx.post(f"{url}/aenv/leases", json={"ttl": 600}, headers={"X-API-KEY": ALICE},
                       trust_env=False, timeout=30).json()  # fmt: skip
    r = _get(url, f"/aenv/leases/{lease['leaseID']}", BOB)
    assert r.status_code == 404 and lease["leaseID"] not in _get(url, "/aenv/leases", BOB).text
    vol = httpx.post(f"{url}/volumes", json={"name": "alice-data"}, headers={"X-API-KEY": ALICE},
                     trust_env=False, timeout=30).json()  # fmt: skip
    assert _get(url, f"/volumes/{vol['volumeID']}", BOB).status_code == 404
    assert vol["volumeID"] not in _get(url, "/volumes", BOB).text
    # Bob may use the same volume name: names are per team
    mine = httpx.post(f"{url}/volumes", json={"name": "alice-data"}, headers={"X-API-KEY": BOB},
                      trust_env=False, timeout=30)  # fmt: skip
    assert mine.status_code == 201 and mine.json()["volumeID"] != vol["volumeID"]
    for key, v in ((ALICE, vol), (BOB, mine.json())):
        httpx.delete(f"{url}/volumes/{v['volumeID']}", headers={"X-API-KEY": key}, trust_env=False, timeout=30)
    httpx.delete(f"{url}/aenv/leases/{lease['leaseID']}", headers={"X-API-KEY": ALICE}, trust_env=False, timeout=30)


def test_teams_survive_a_restart(cluster: NodeCluster, tmp_path: Path) -> None:
    """Who owns what is in the database: after a restart Bob still cannot see Alice's sandbox."""
    url = cluster.url(1)
    alice = Sandbox.create("base", api_key=ALICE, **_sdk(url))
    try:
        node = cluster.nodes[1]
        assert node is not None
        from aenv.testing.server import stop_server

        stop_server(node)
        cluster.start_node(1)
        assert _get(url, f"/sandboxes/{alice.sandbox_id}", BOB).status_code == 404
        assert _get(url, f"/sandboxes/{alice.sandbox_id}", ALICE).status_code == 200
    finally:
        Sandbox.kill(alice.sandbox_id, api_key=ALICE, **_sdk(url))


@pytest.mark.parametrize("through", ["node", "gateway"])
def test_every_route_with_another_teams_ids_answers_as_unknown(cluster: NodeCluster, through: str) -> None:
    """The route table of ``tests/unit/api/test_teams_api.py``, against the real processes: Bob with Alice's
    IDs and Bob with IDs nobody has get the same status and body (the IDs aside) on every keyed route."""
    from aenv.api.app import create_app
    from aenv.config import Settings
    from tests.unit.api.test_teams_api import UNKEYED, UNKEYED_PREFIX, _call, _unknown_like

    url = cluster.url(0) if through == "node" else cluster.gw
    with httpx.Client(base_url=url, trust_env=False, timeout=120) as client:
        def post(path: str, body: dict[str, object]) -> dict[str, str]:
            r = client.post(path, json=body, headers={"X-API-KEY": ALICE})
            assert r.status_code in (200, 201, 202), r.text
            return dict(r.json())

        sid = post("/v2/sandboxes", {"templateID": "base"})["sandboxID"]
        snap = post(f"/sandboxes/{sid}/snapshots", {"name": f"walk-{through}"})["snapshotID"]
        ids = {"sandbox_id": sid, "snapshot_id": snap, "template_id": snap, "alias": f"walk-{through}",
               "volume_id": post("/volumes", {"name": f"walk-{through}"})["volumeID"],
               "lease_id": post("/aenv/leases", {"ttl": 600})["leaseID"],
               "build_id": post("/v3/templates", {"name": f"walk-tpl-{through}"})["buildID"],
               "template": snap, "files_hash": "ab" * 32, "tag": "default", "secret_id": str(uuid.uuid4())}  # fmt: skip
        table = _route_table(create_app(Settings(), ensure_base=False))
        checked = 0
        for method, path in table:
            if path in UNKEYED or path.startswith(UNKEYED_PREFIX) or "{" not in path:
                continue
            theirs = _call(client, method, path, ids, {"X-API-KEY": BOB})  # type: ignore[arg-type]
            unknown = _call(client, method, path, _unknown_like(ids), {"X-API-KEY": BOB})  # type: ignore[arg-type]
            assert theirs == unknown, f"{method} {path}: Alice's IDs {theirs}, unknown IDs {unknown}"
            checked += 1
        assert checked >= 40
        assert client.get(f"/sandboxes/{sid}", headers={"X-API-KEY": ALICE}).json()["state"] == "running"
        client.delete(f"/sandboxes/{sid}", headers={"X-API-KEY": ALICE})
        client.delete(f"/volumes/{ids['volume_id']}", headers={"X-API-KEY": ALICE})
        client.delete(f"/aenv/leases/{ids['lease_id']}", headers={"X-API-KEY": ALICE})


def _route_table(app: object) -> list[tuple[str, str]]:
    """The route table of an app object (``_routes`` reads it off a TestClient's ``app``)."""
    from types import SimpleNamespace

    from tests.unit.api.test_teams_api import _routes

    return _routes(SimpleNamespace(app=app))  # type: ignore[arg-type]

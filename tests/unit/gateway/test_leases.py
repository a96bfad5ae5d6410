"""Leases through the gateway: one lease made on every live node under one ID, undone where a node refuses,
and each lease's answers merged (sandboxes summed, ended when any node ended it)."""

from __future__ import annotations

from typing import Any

from starlette.testclient import TestClient

from aenv.gateway.forward import Relayed
from aenv.gateway.leases import LEASE_ID_HEADER, merge, new_lease_id, router
from aenv.gateway.nodes import Node
from tests.unit.gateway.three_nodes import answer, client


class Nodes:
    """Three nodes that answer lease routes from per-node tables; every request is recorded."""

    def __init__(self, refuse_create: str | None = None) -> None:
        self.leases: dict[str, dict[str, dict[str, Any]]] = {"n1": {}, "n2": {}, "n3": {}}
        self.refuse_create = refuse_create
        self.seen: list[tuple[str, str, str, dict[str, str]]] = []

    async def send(self, request: Any, node: Node, body: bytes | None = None, path: str | None = None,
                   extra: dict[str, str] | None = None, method: str | None = None, **_: Any) -> Relayed:  # fmt: skip
        verb, where = method or request.method, path or request.url.path
        self.seen.append((node.id, verb, where, extra or {}))
        held = self.leases[node.id]
        if verb == "POST" and where == "/aenv/leases":
            if node.id == self.refuse_create:
                return _answer(node, 409, {"code": 409, "message": "lease exists"})
            lease_id = (extra or {})[LEASE_ID_HEADER]
            held[lease_id] = {"leaseID": lease_id, "state": "live", "sandboxes": 0, "expiresAt": 10.0,
                              "createdAt": 1.0}  # fmt: skip
            return _answer(node, 201, held[lease_id])
        if where == "/aenv/leases":
            return _answer(node, 200, list(held.values()))
        lease_id = where.split("/")[3]
        if lease_id not in held:
            return _answer(node, 404, {"code": 404, "message": "not found"})
        if verb == "DELETE":
            lease = held.pop(lease_id)
            return _answer(node, 200, {**lease, "state": "ended", "killed": [f"sbx-{node.id}"], "failed": []})
        return _answer(node, 200, held[lease_id])


def _answer(node: Node, status: int, payload: Any) -> Relayed:
    return answer(node, status, payload)


def _client(fake: Nodes) -> TestClient:
    return client(fake, router)


def test_a_lease_is_made_on_every_node_under_one_id() -> None:
    fake = Nodes()
    made = _client(fake).post("/aenv/leases", json={"ttl": 30})
    assert made.status_code == 201, made.text
    lease_id = made.json()["leaseID"]
    assert sorted(made.json()["nodes"]) == ["n1", "n2", "n3"]
    assert all(lease_id in fake.leases[n] for n in ("n1", "n2", "n3"))
    assert {seen[3][LEASE_ID_HEADER] for seen in fake.seen} == {lease_id}


def test_a_refused_create_is_undone_where_it_was_made() -> None:
    fake = Nodes(refuse_create="n2")
    made = _client(fake).post("/aenv/leases", json={"ttl": 30})
    assert made.status_code == 409 and "node n2" in made.json()["message"], made.text
    assert fake.leases == {"n1": {}, "n2": {}, "n3": {}}
    assert {(n, verb) for n, verb, _, _ in fake.seen if verb == "DELETE"} == {("n1", "DELETE"), ("n3", "DELETE")}


def test_heartbeat_and_end_reach_every_node_and_merge() -> None:
    fake = Nodes()
    client = _client(fake)
    lease_id = client.post("/aenv/leases", json={"ttl": 30}).json()["leaseID"]
    fake.leases["n1"][lease_id]["sandboxes"] = 2
    fake.leases["n3"][lease_id]["sandboxes"] = 1
    del fake.leases["n2"][lease_id]  # a node that lost it (restarted on an empty store, say)
    beat = client.post(f"/aenv/leases/{lease_id}/heartbeat")
    assert beat.status_code == 200 and beat.json()["sandboxes"] == 3 and beat.json()["nodes"] == ["n1", "n3"]
    assert [got["leaseID"] for got in client.get("/aenv/leases").json()] == [lease_id]
    ended = client.delete(f"/aenv/leases/{lease_id}")
    assert ended.status_code == 200 and sorted(ended.json()["killed"]) == ["sbx-n1", "sbx-n3"], ended.text
    assert client.post(f"/aenv/leases/{lease_id}/heartbeat").status_code == 404  # no node holds it now


def test_merge_sums_sandboxes_and_an_end_anywhere_ends_it() -> None:
    a = {"leaseID": "l", "state": "live", "sandboxes": 2, "expiresAt": 5.0}
    b = {"leaseID": "l", "state": "ended", "sandboxes": 0, "expiresAt": 3.0, "endReason": "expired", "endedAt": 4.0}
    assert merge([a]) == a
    got = merge([a, b])
    assert got["sandboxes"] == 2 and got["state"] == "ended" and got["endReason"] == "expired" and got["expiresAt"] == 5.0


def test_lease_ids_are_what_the_nodes_accept() -> None:
    from aenv.core.leases import LEASE_ID

    assert all(LEASE_ID.fullmatch(new_lease_id()) for _ in range(50))

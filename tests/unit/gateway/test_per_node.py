"""The image cache and the webhooks' log through the gateway: asked of every live node, merged into one
node's shape (sums, joined lists naming their node), nodes down named, a refusal only when no node could."""

from __future__ import annotations

from typing import Any

from starlette.testclient import TestClient

from aenv.gateway.forward import NodeUnreachable, Relayed
from aenv.gateway.nodes import Node
from aenv.gateway.per_node import router
from tests.unit.gateway.three_nodes import answer, client


def _cache(node: str, used: int) -> dict[str, Any]:
    return {"usage": {"used": used, "budget": 1000, "pinned": 0, "entries": 1},
            "entries": [{"digest": f"sha256:{node}", "kind": "layer", "size": used, "pinned_by": []}],
            "lazy": {"lazy_images": True, "lazy_images_reason": "FUSE reader (aenv-lazyd)", "budget": 500,
                     "images": [{"name": f"img-{node}", "cached": 5}]}}  # fmt: skip


class Nodes:
    """n1 and n2 answer; n3 is unreachable. ``no_template`` nodes answer a pin with 404."""

    def __init__(self, no_template: tuple[str, ...] = ()) -> None:
        self.no_template = no_template
        self.seen: list[tuple[str, str, str]] = []

    async def send(self, request: Any, node: Node, body: bytes | None = None, **_: Any) -> Relayed:
        self.seen.append((node.id, request.method, request.url.path))
        if node.id == "n3":
            raise NodeUnreachable(node, ConnectionRefusedError("connection refused"))
        path = request.url.path
        if path == "/aenv/cache":
            return _answer(node, 200, _cache(node.id, 100 if node.id == "n1" else 50))
        if path.startswith("/aenv/cache/pin/"):
            if node.id in self.no_template:
                return _answer(node, 404, {"code": 404, "message": "template 'x' not found"})
            return _answer(node, 200, {"pinned": True, "cached": 10, "stored": 10})
        if path == "/aenv/cache/prune":
            return _answer(node, 200, {"removed": [f"sha256:{node.id}"], "freed": 7})
        if path == "/aenv/webhooks":
            return _answer(node, 200, {"urls": [f"http://hook/{node.id}"], "signed": True, "events": ["a"],
                                       "attempts": 5})  # fmt: skip
        created = {"n1": [3.0, 1.0], "n2": [2.0]}[node.id]
        return _answer(node, 200, [{"id": f"{node.id}-{t}", "createdAt": t} for t in created])


def _answer(node: Node, status: int, payload: Any) -> Relayed:
    return answer(node, status, payload)


def _client(fake: Nodes) -> TestClient:
    return client(fake, router)


def test_cache_listing_is_summed_and_joined_in_one_nodes_shape() -> None:
    got = _client(Nodes()).get("/aenv/cache")
    assert got.status_code == 200, got.text
    body = got.json()
    assert body["usage"] == {"used": 150, "budget": 2000, "pinned": 0, "entries": 2}
    assert [(e["digest"], e["node"]) for e in body["entries"]] == [("sha256:n1", "n1"), ("sha256:n2", "n2")]
    assert body["lazy"]["budget"] == 1000 and {i["node"] for i in body["lazy"]["images"]} == {"n1", "n2"}
    assert sorted(body["nodes"]) == ["n1", "n2"] and body["nodesDown"] == ["n3"]
    assert got.headers["x-aenv-nodes-down"] == "n3"


def test_a_pin_reaches_every_node_that_has_the_template() -> None:
    fake = Nodes(no_template=("n2",))
    got = _client(fake).post("/aenv/cache/pin/x")
    assert got.status_code == 200, got.text
    assert (got.json()["pinned"], got.json()["cached"]) == (True, 10)
    assert got.json()["refused"] == ["node n2: 404 template 'x' not found"]
    assert {(n, m) for n, m, _ in fake.seen} == {("n1", "POST"), ("n2", "POST"), ("n3", "POST")}


def test_a_pin_no_node_could_do_is_that_refusal() -> None:
    got = _client(Nodes(no_template=("n1", "n2"))).post("/aenv/cache/pin/x")
    assert got.status_code == 404 and "not found" in got.json()["message"]


def test_prune_and_webhooks_are_merged() -> None:
    client = _client(Nodes())
    pruned = client.post("/aenv/cache/prune?all=true").json()
    assert (sorted(pruned["removed"]), pruned["freed"]) == (["sha256:n1", "sha256:n2"], 14)
    hooks = client.get("/aenv/webhooks").json()
    assert hooks["urls"] == ["http://hook/n1", "http://hook/n2"] and hooks["signed"] and hooks["attempts"] == 5


def test_deliveries_are_one_list_newest_first_cut_to_the_limit() -> None:
    got = _client(Nodes()).get("/aenv/webhooks/deliveries?limit=2")
    assert [(d["id"], d["node"]) for d in got.json()] == [("n1-3.0", "n1"), ("n2-2.0", "n2")]
    assert got.headers["x-aenv-nodes-down"] == "n3"

"""Routes the newest E2B client calls, through the gateway: batch metrics asked of every live node and
merged (a node down named, not fatal), default templates answered by one node; the secrets API
answered by one node in a cluster (one that cannot be reached skipped, each write sent once), and a
501 naming ``cluster_redis`` over a static node list, where the nodes do not share secrets."""

from __future__ import annotations

from typing import Any

from aenv.gateway.control import router
from aenv.gateway.forward import NodeUnreachable, Relayed
from aenv.gateway.nodes import Node
from aenv.gateway.secrets import router as secrets_router
from tests.unit.gateway.three_nodes import answer, client


class Nodes:
    """n1 and n2 each hold a sandbox; n3 is unreachable."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    async def send(self, request: Any, node: Node, body: bytes | None = None, **_: Any) -> Relayed:
        self.seen.append((node.id, request.url.path))
        if node.id == "n3":
            raise NodeUnreachable(node, ConnectionRefusedError("connection refused"))
        path = request.url.path
        if path == "/sandboxes/metrics":
            if not request.query_params.get("sandbox_ids"):
                return answer(node, 400, {"code": 400, "message": "sandbox_ids: name at least one sandbox"})
            return answer(node, 200, {"sandboxes": {f"s-{node.id}": {"cpuCount": 2}}})
        if path == "/default-templates":
            return answer(node, 200, [{"templateID": "base"}])
        return answer(node, 201 if request.method == "POST" else 200, {"node": node.id})


def test_batch_metrics_merge_every_live_nodes_answer() -> None:
    fake = Nodes()
    got = client(fake, router).get("/sandboxes/metrics", params={"sandbox_ids": "s-n1,s-n2"})
    assert got.status_code == 200, got.text
    assert got.json() == {"sandboxes": {"s-n1": {"cpuCount": 2}, "s-n2": {"cpuCount": 2}}}
    assert "n3" in got.headers["x-aenv-nodes-down"]
    assert {n for n, _ in fake.seen} == {"n1", "n2", "n3"}  # never mistaken for a sandbox named "metrics"


def test_a_bad_batch_request_is_the_nodes_400() -> None:
    got = client(Nodes(), router).get("/sandboxes/metrics")
    assert got.status_code == 400 and "sandbox_ids" in got.json()["message"]


def test_default_templates_are_one_nodes_answer() -> None:
    assert client(Nodes(), router).get("/default-templates").json() == [{"templateID": "base"}]


def test_secrets_in_a_cluster_are_one_live_nodes_answer() -> None:
    fake = Nodes()
    c = client(fake, secrets_router)
    c.app.state.gateway.shared_secrets = True  # type: ignore[attr-defined]
    nodes = c.app.state.gateway.nodes.nodes  # type: ignore[attr-defined]
    nodes["n1"].inflight = nodes["n2"].inflight = 5  # n3, the least loaded, is tried first: unreachable
    for method, path in (("GET", "/secrets"), ("POST", "/secrets"), ("POST", "/secrets/s1"), ("DELETE", "/secrets/s1")):
        fake.seen.clear()
        got = c.request(method, path, json={"name": "n", "value": "v"} if method == "POST" else None)
        assert got.status_code in (200, 201) and got.json()["node"] in ("n1", "n2"), (method, path, got.text)
        assert [n for n, _ in fake.seen] == ["n3", got.json()["node"]]  # once, after the unreachable one


def test_secrets_over_a_static_node_list_are_a_501_naming_cluster_redis() -> None:
    fake = Nodes()
    for method, path in (("GET", "/secrets"), ("POST", "/secrets"), ("DELETE", "/secrets/s1")):
        got = client(fake, secrets_router).request(method, path)
        assert got.status_code == 501 and "cluster_redis" in got.json()["message"], (method, path, got.text)
    assert fake.seen == []

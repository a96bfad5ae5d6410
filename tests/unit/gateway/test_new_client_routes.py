"""Routes the newest E2B client calls, through the gateway: batch metrics asked of every live node and
merged (a node down named, not fatal), default templates and the secrets API answered by one node,
never the gateway's 501."""

from __future__ import annotations

from typing import Any

from aenv.gateway.control import router
from aenv.gateway.forward import NodeUnreachable, Relayed
from aenv.gateway.nodes import Node
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
        return answer(node, 400, {"code": 400, "message": "the secrets API (/secrets) is not implemented"})


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


def test_default_templates_and_secrets_are_one_nodes_answer() -> None:
    c = client(Nodes(), router)
    assert c.get("/default-templates").json() == [{"templateID": "base"}]
    for method, path in (("GET", "/secrets"), ("POST", "/secrets"), ("DELETE", "/secrets/s1")):
        got = c.request(method, path)
        assert got.status_code == 400 and "secrets" in got.json()["message"], (method, path, got.text)

"""Template reads and deletes through the gateway: a list is every node's, merged; a read of one
template goes on to the next node while nodes answer 404 (a built template is where it was built and
where it was fetched); a delete reaches every live node (no 501): 204 when some node deleted it."""

from __future__ import annotations

from typing import Any

from aenv.gateway.control import router
from aenv.gateway.forward import NodeUnreachable, Relayed
from aenv.gateway.nodes import Node
from tests.unit.gateway.three_nodes import answer, client

NOT_FOUND = (404, {"code": 404, "message": "template 't1' not found"})


class Nodes:
    """Each node's answer by id; a missing id is unreachable."""

    def __init__(self, answers: dict[str, tuple[int, Any]]) -> None:
        self.answers = answers
        self.seen: list[tuple[str, str, str]] = []

    async def send(self, request: Any, node: Node, body: bytes | None = None, **_: Any) -> Relayed:
        self.seen.append((node.id, request.method, request.url.path))
        if node.id not in self.answers:
            raise NodeUnreachable(node, ConnectionRefusedError("connection refused"))
        status, payload = self.answers[node.id]
        return answer(node, status, payload)


def test_the_list_is_every_nodes_merged_once_per_template() -> None:
    base, built = {"templateID": "base", "aliases": ["base"]}, {"templateID": "t1", "aliases": ["x"]}
    fake = Nodes({"n1": (200, [base]), "n2": (200, [base, built])})
    got = client(fake, router).get("/templates")
    assert got.status_code == 200 and got.json() == [base, built]
    assert got.headers["x-aenv-nodes-down"] == "n3"


def test_a_read_goes_on_while_nodes_do_not_know_the_template() -> None:
    fake = Nodes({"n1": NOT_FOUND, "n2": (200, {"templateID": "t1"}), "n3": NOT_FOUND})
    got = client(fake, router).get("/templates/aliases/x")
    assert got.status_code == 200 and got.json() == {"templateID": "t1"} and got.headers["x-aenv-node"] == "n2"
    fake = Nodes({n: NOT_FOUND for n in ("n1", "n2", "n3")})
    got = client(fake, router).get("/templates/t1")
    assert got.status_code == 404 and len(fake.seen) == 3


def test_a_delete_reaches_every_node() -> None:
    fake = Nodes({"n1": (204, None), "n2": NOT_FOUND, "n3": (204, None)})
    got = client(fake, router).delete("/templates/t1")
    assert got.status_code == 204
    assert sorted(n for n, method, path in fake.seen if method == "DELETE" and path == "/templates/t1") == ["n1", "n2", "n3"]
    fake = Nodes({"n1": (204, None), "n2": (409, {"code": 409, "message": "template 't1' is used by running sandboxes"})})
    got = client(fake, router).delete("/templates/t1")
    assert got.status_code == 409 and got.headers["x-aenv-node"] == "n2"
    fake = Nodes({n: NOT_FOUND for n in ("n1", "n2", "n3")})
    assert client(fake, router).delete("/templates/t1").status_code == 404

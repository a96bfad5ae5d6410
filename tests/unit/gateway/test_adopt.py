"""connect/resume through the gateway of a sandbox whose node is down: adopted by a live node when its
pause is published (the node's ``/aenv/sandboxes/{id}/adopt``), else the 404 naming the lost node."""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
from starlette.requests import Request

from aenv.gateway.control import Gateway
from aenv.gateway.directory import Locator
from aenv.gateway.forward import NodeUnreachable, Relayed
from aenv.gateway.nodes import Node, NodeSet
from tests.unit.gateway.test_directory import FakeDirectory


class Forwarder:
    """Answers per (node, path): an exception to raise, or (status, body); records what was sent where."""

    def __init__(self, nodes: NodeSet, answers: dict[tuple[str, str], Any]) -> None:
        self.nodes = nodes
        self.answers = answers
        self.sent: list[tuple[str, str]] = []

    async def send(self, request: Request, node: Node, body: bytes | None = None, path: str | None = None,
                   **_: Any) -> Relayed:  # fmt: skip
        key = (node.id, path or request.url.path)
        self.sent.append(key)
        answer = self.answers[key]
        if callable(answer):
            answer = answer()
        if isinstance(answer, Exception):
            self.nodes.mark_down(node, "refused")
            raise NodeUnreachable(node, answer)
        status, payload = answer
        return Relayed(status, [("content-type", "application/json")], json.dumps(payload).encode(), node)


def _request(sandbox_id: str) -> Request:
    data = b'{"timeout": 60}'

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": data, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": f"/sandboxes/{sandbox_id}/connect", "headers": [],
             "query_string": b""}  # fmt: skip
    return Request(scope, receive)


def _gateway(answers: dict[tuple[str, str], Any], bindings: dict[str, str]) -> tuple[Gateway, Forwarder]:
    nodes = NodeSet([Node(f"n{i}", f"http://h:{i}", "h", i) for i in (1, 2, 3)], httpx.AsyncClient(), None)
    for n in nodes.nodes.values():
        n.up = True
    nodes.fence(nodes.nodes["n1"], "declared dead by the cluster at 2026-01-01T00:00:00Z: raylet gone")
    fwd = Forwarder(nodes, answers)
    gw = Gateway(nodes, Locator(nodes, FakeDirectory(bindings)), fwd, random.Random(0))  # type: ignore[arg-type]
    return gw, fwd


ADOPT = "/aenv/sandboxes/sbx1/adopt"
ANSWER = {"sandboxID": "sbx1", "envdAccessToken": "tok"}


async def test_a_published_pause_is_adopted_by_a_live_node() -> None:
    gw, fwd = _gateway({("n2", ADOPT): (201, ANSWER), ("n3", ADOPT): (201, ANSWER)},
                       {"sbx1": "n1", "published:sbx1": "yes"})  # fmt: skip
    got = await gw.connect(_request("sbx1"), "sbx1")
    assert got.status_code == 201 and json.loads(bytes(got.body)) == ANSWER
    assert len(fwd.sent) == 1 and fwd.sent[0][1] == ADOPT and fwd.sent[0][0] != "n1"
    assert gw.locator.cached("sbx1") is gw.nodes.nodes[fwd.sent[0][0]]  # rebound to its new node


async def test_an_unreachable_adopter_is_skipped() -> None:
    gw, fwd = _gateway({("n2", ADOPT): OSError("refused"), ("n3", ADOPT): OSError("refused")},
                       {"sbx1": "n1", "published:sbx1": "yes"})  # fmt: skip
    got = await gw.connect(_request("sbx1"), "sbx1")
    assert {n for n, _ in fwd.sent} == {"n2", "n3"}
    body = json.loads(bytes(got.body))
    assert (got.status_code, body["reason"], body["node"]) == (404, "node_down", "n1")


async def test_without_a_published_pause_the_lost_node_is_named() -> None:
    gw, fwd = _gateway({}, {"sbx1": "n1"})
    got = await gw.connect(_request("sbx1"), "sbx1")
    body = json.loads(bytes(got.body))
    assert (got.status_code, body["reason"], body["node"]) == (404, "node_down", "n1")
    assert "raylet gone" in body["message"] and fwd.sent == []


async def test_a_live_owner_gets_the_connect() -> None:
    gw, fwd = _gateway({("n2", "/sandboxes/sbx1/connect"): (200, ANSWER)}, {"sbx1": "n2", "published:sbx1": "yes"})
    got = await gw.connect(_request("sbx1"), "sbx1")
    assert got.status_code == 200 and fwd.sent == [("n2", "/sandboxes/sbx1/connect")]


async def test_an_adoption_another_node_won_is_connected_there() -> None:
    bindings = {"sbx1": "n1", "published:sbx1": "yes"}

    def lost_the_race() -> tuple[int, Any]:
        bindings["sbx1"] = "n3"  # another gateway's connect had n3 adopt it a moment earlier
        return 409, {"message": "sandbox sbx1 cannot be adopted: it is live on node n3"}

    gw, fwd = _gateway({("n2", ADOPT): lost_the_race, ("n3", ADOPT): lost_the_race,
                        ("n3", "/sandboxes/sbx1/connect"): (200, ANSWER)}, bindings)  # fmt: skip
    gw.nodes.nodes["n3"].counts = {"running": 10}  # n2 is tried first
    got = await gw.connect(_request("sbx1"), "sbx1")
    assert got.status_code == 200 and fwd.sent == [("n2", ADOPT), ("n3", "/sandboxes/sbx1/connect")]


TCG = {"accel": "tcg", "cpu": "max", "qemu": "7.2"}
KVM = {"accel": "kvm", "cpu": "AMD EPYC #0011aabb", "qemu": "7.2"}
REFUSED = (409, {"code": 409, "message": "snapshot 'p1' was taken on tcg ...", "reason": "machine",
                 "snapshotMachine": TCG, "nodeMachine": KVM})  # fmt: skip


async def test_an_adopter_of_another_machine_passes_it_to_one_of_the_pauses_machine() -> None:
    gw, fwd = _gateway({("n2", ADOPT): REFUSED, ("n3", ADOPT): (201, ANSWER)}, {"sbx1": "n1", "published:sbx1": "yes"})
    n2, n3 = gw.nodes.nodes["n2"], gw.nodes.nodes["n3"]
    n2.machine, n3.machine, n3.counts = KVM, TCG, {"running": 10}  # n2 is tried first
    got = await gw.connect(_request("sbx1"), "sbx1")
    assert got.status_code == 201 and fwd.sent == [("n2", ADOPT), ("n3", ADOPT)]
    assert gw.locator.cached("sbx1") is n3


async def test_no_adopter_of_the_pauses_machine_is_a_409() -> None:
    gw, fwd = _gateway({("n2", ADOPT): REFUSED, ("n3", ADOPT): REFUSED}, {"sbx1": "n1", "published:sbx1": "yes"})
    gw.nodes.nodes["n2"].machine = gw.nodes.nodes["n3"].machine = KVM
    got = await gw.connect(_request("sbx1"), "sbx1")
    body = json.loads(bytes(got.body))
    assert (got.status_code, body["reason"], body["snapshotMachine"]) == (409, "machine", TCG)
    assert "published pause of sandbox 'sbx1'" in body["message"] and len(fwd.sent) == 1

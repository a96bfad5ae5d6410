"""Creates through the gateway: a node that cannot be reached or refuses for capacity is skipped, the
answer's sandbox ID is bound to the node that made it, and with no node left the answer says why."""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import pytest
from starlette.requests import Request

from aenv.gateway.control import Gateway
from aenv.gateway.directory import Locator
from aenv.gateway.forward import NodeUnreachable, Relayed
from aenv.gateway.nodes import Node, NodeSet
from tests.unit.gateway.test_directory import FakeDirectory


class FakeForwarder:
    """Answers per node: an exception to raise, or (status, body)."""

    def __init__(self, nodes: NodeSet, answers: dict[str, Any]) -> None:
        self.nodes = nodes
        self.answers = answers
        self.sent: list[str] = []

    async def send(self, request: Request, node: Node, body: bytes | None = None, **_: Any) -> Relayed:
        self.sent.append(node.id)
        assert node.inflight == 1  # counted while the create is relayed
        answer = self.answers[node.id]
        if isinstance(answer, Exception):
            self.nodes.mark_down(node, "refused")
            raise NodeUnreachable(node, answer)
        status, payload = answer
        return Relayed(status, [("content-type", "application/json")], json.dumps(payload).encode(), node)


def _request(body: dict[str, Any]) -> Request:
    data = json.dumps(body).encode()

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": data, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v2/sandboxes", "headers": [], "query_string": b""}
    return Request(scope, receive)


def _gateway(answers: dict[str, Any], bindings: dict[str, str] | None = None) -> tuple[Gateway, FakeForwarder]:
    nodes = NodeSet([Node(f"n{i}", f"http://h:{i}", "h", i) for i in (1, 2, 3)], httpx.AsyncClient(), None)
    for i, n in enumerate(nodes.nodes.values()):
        n.up, n.counts = True, {"running": i}  # n1 is the emptiest, then n2, then n3
    fwd = FakeForwarder(nodes, answers)
    gw = Gateway(nodes, Locator(nodes, FakeDirectory(bindings or {})), fwd, random.Random(0))  # type: ignore[arg-type]
    return gw, fwd


async def test_an_unreachable_node_is_skipped_and_marked_down() -> None:
    gw, fwd = _gateway({"n1": OSError("refused"), "n2": (201, {"sandboxID": "sbx1"}), "n3": (201, {})})
    r = await gw.create(_request({"templateID": "base"}))
    assert r.status_code == 201 and r.headers["x-aenv-node"] == "n2"
    assert fwd.sent == ["n1", "n2"]
    assert not gw.nodes.nodes["n1"].up
    assert gw.locator.cached("sbx1") is gw.nodes.nodes["n2"]
    assert gw.nodes.nodes["n2"].placed == 1 and gw.nodes.nodes["n2"].inflight == 0


async def test_a_capacity_refusal_tries_the_next_node() -> None:
    full = (429, {"code": 429, "message": "full", "reason": "capacity"})
    gw, fwd = _gateway({"n1": full, "n2": full, "n3": (201, {"sandboxID": "sbx3"})})
    r = await gw.create(_request({"templateID": "base"}))
    assert r.status_code == 201 and fwd.sent == ["n1", "n2", "n3"]


async def test_the_last_capacity_refusal_is_the_answer() -> None:
    full = (429, {"code": 429, "message": "full", "reason": "capacity"})
    gw, fwd = _gateway({"n1": full, "n2": full, "n3": full})
    r = await gw.create(_request({}))
    assert r.status_code == 429 and fwd.sent == ["n1", "n2", "n3"]


async def test_a_quota_refusal_is_not_retried_elsewhere() -> None:
    gw, fwd = _gateway({"n1": (429, {"reason": "quota"}), "n2": (201, {}), "n3": (201, {})})
    r = await gw.create(_request({}))
    assert r.status_code == 429 and fwd.sent == ["n1"]


async def test_no_node_left_is_a_503_naming_each() -> None:
    gw, _ = _gateway({n: OSError("refused") for n in ("n1", "n2", "n3")})
    r = await gw.create(_request({}))
    body = json.loads(bytes(r.body))
    assert r.status_code == 503 and body["reason"] == "no_node"
    assert all(f"n{i} http://h:{i}: refused" in body["message"] for i in (1, 2, 3))


@pytest.mark.parametrize("key", ["rollout-1", "rollout-2"])
async def test_an_idempotency_key_goes_to_one_node(key: str) -> None:
    gw, fwd = _gateway({n: (201, {}) for n in ("n1", "n2", "n3")})
    for _ in range(3):
        req = _request({})
        req.scope["headers"] = [(b"idempotency-key", key.encode())]
        await gw.create(req)
    assert len(set(fwd.sent)) == 1


async def test_a_snapshot_made_elsewhere_is_found_and_followed() -> None:
    gw, fwd = _gateway({"n1": (404, {"code": 404, "message": "template 'snap9' not found"}), "n2": (201, {}),
                        "n3": (201, {"sandboxID": "kid"})}, {"snap9": "n3"})  # fmt: skip (only n3 has the snapshot)
    r = await gw.create(_request({"templateID": "snap9"}))
    assert r.status_code == 201 and fwd.sent == ["n1", "n3"]
    r = await gw.create(_request({"templateID": "snap9"}))
    assert fwd.sent == ["n1", "n3", "n3"]  # remembered: straight there


async def test_an_unknown_template_is_the_nodes_404() -> None:
    gw, fwd = _gateway({n: (404, {"code": 404, "message": "template 'nope' not found"}) for n in ("n1", "n2", "n3")})
    r = await gw.create(_request({"templateID": "nope"}))
    assert r.status_code == 404 and fwd.sent == ["n1"]


async def test_a_node_without_the_creates_lease_is_skipped() -> None:
    """A node that was down when the lease was made does not hold it: the create goes to one that does."""
    unknown = (400, {"code": 400, "message": "no lease", "reason": "lease_unknown"})
    gw, fwd = _gateway({"n1": unknown, "n2": (201, {"sandboxID": "sbx2"}), "n3": (201, {})})
    r = await gw.create(_request({"templateID": "base", "metadata": {"aenv.lease": "l1"}}))
    assert r.status_code == 201 and fwd.sent == ["n1", "n2"]
    gw, fwd = _gateway({"n1": unknown, "n2": unknown, "n3": unknown})
    r = await gw.create(_request({"templateID": "base"}))
    assert r.status_code == 400 and json.loads(r.body)["reason"] == "lease_unknown" and len(fwd.sent) == 3


TCG = {"accel": "tcg", "cpu": "max", "qemu": "7.2"}
KVM = {"accel": "kvm", "cpu": "AMD EPYC #0011aabb", "qemu": "7.2"}


def _machine_refusal(node_machine: dict[str, str]) -> tuple[int, dict[str, Any]]:
    return 409, {"code": 409, "message": "snapshot 'snap1' was taken on tcg ...", "reason": "machine",
                 "snapshotMachine": TCG, "nodeMachine": node_machine}  # fmt: skip


async def test_a_warm_node_is_preferred() -> None:
    gw, fwd = _gateway({n: (201, {}) for n in ("n1", "n2", "n3")})
    n2 = gw.nodes.nodes["n2"]
    n2.counts, n2.warm = {"paused": 2}, {"base": 1}  # busier than n1 (load 0.5 against 0), but base is warm
    for _ in range(5):
        await gw.create(_request({"templateID": "base"}))
    assert set(fwd.sent) == {"n2"}
    await gw.create(_request({"templateID": "other"}))
    assert fwd.sent[-1] == "n1"  # not warm for another template


async def test_a_machine_refusal_is_retried_on_a_node_of_the_snapshots_machine() -> None:
    gw, fwd = _gateway({"n1": _machine_refusal(KVM), "n2": (201, {"sandboxID": "kid"}), "n3": (201, {})})
    nodes = gw.nodes.nodes
    nodes["n1"].machine, nodes["n2"].machine, nodes["n3"].machine = KVM, TCG, KVM
    r = await gw.create(_request({"templateID": "snap1"}))
    assert r.status_code == 201 and fwd.sent == ["n1", "n2"]  # n3 (KVM as well) never tried
    assert gw.machines.get("snap1") == TCG
    r = await gw.create(_request({"templateID": "snap1"}))
    assert fwd.sent[-1] == "n2"  # learnt: straight to the one node of its machine


async def test_a_known_snapshot_machine_skips_other_nodes_up_front() -> None:
    gw, fwd = _gateway({n: (201, {}) for n in ("n1", "n2", "n3")})
    nodes = gw.nodes.nodes
    nodes["n1"].machine, nodes["n2"].machine, nodes["n3"].machine = KVM, KVM, TCG
    gw.machines.learn_snapshot({"snapshotID": "snap1", "names": ["step-1"], "machine": TCG})
    for template in ("snap1", "step-1"):
        await gw.create(_request({"templateID": template}))
    assert fwd.sent == ["n3", "n3"]


async def test_no_node_of_the_snapshots_machine_is_a_409_naming_the_machines() -> None:
    gw, fwd = _gateway({n: _machine_refusal(KVM) for n in ("n1", "n2", "n3")})
    for n in gw.nodes.nodes.values():
        n.machine = KVM
    r = await gw.create(_request({"templateID": "snap1"}))
    body = json.loads(bytes(r.body))
    assert r.status_code == 409 and body["reason"] == "machine" and body["snapshotMachine"] == TCG
    assert fwd.sent == ["n1"]  # the refusal named its machine: the other nodes are not of it either
    assert "tcg, cpu max, QEMU 7.2" in body["message"] and "n2: kvm, cpu AMD EPYC" in body["message"]

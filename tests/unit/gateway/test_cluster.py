"""The gateway following the cluster directory: node records join, fence and readmit nodes; the
node set never brings a fenced node back on a probe alone."""

from __future__ import annotations

import httpx
import pytest

from aenv.directory.reader import NodeRecord
from aenv.gateway.cluster import apply_records
from aenv.gateway.directory import Locator, OwnerDown
from aenv.gateway.nodes import NodeSet


class NoDirectory:
    async def find_sandbox(self, sandbox_id: str) -> str | None:
        return None

    async def find_snapshot(self, snapshot_id: str) -> str | None:
        return None

    async def published(self, sandbox_id: str) -> bool:
        return False


def _rec(node_id: str, status: str = "alive", inc: int = 1, reason: str = "") -> NodeRecord:
    return NodeRecord(node_id, f"http://10.213.0.1{node_id[-1]}:8000", inc, status, 0.0, reason)


@pytest.fixture
def nodes() -> NodeSet:
    return NodeSet([], httpx.AsyncClient(), None)


def test_records_add_nodes(nodes: NodeSet) -> None:
    apply_records(nodes, [_rec("n1"), _rec("n2")])
    assert sorted(nodes.nodes) == ["n1", "n2"]
    assert nodes.nodes["n2"].host == "10.213.0.12" and nodes.nodes["n2"].port == 8000
    assert not nodes.nodes["n1"].up  # up only once a probe answers


async def test_a_dead_record_fences_the_node_until_a_new_incarnation(nodes: NodeSet) -> None:
    apply_records(nodes, [_rec("n1"), _rec("n2")])
    for n in nodes.nodes.values():
        nodes._mark_up(n)
    loc = Locator(nodes, NoDirectory())
    loc.remember("sbx", "n2")
    apply_records(nodes, [_rec("n1"), _rec("n2", "dead", 2, "raylet died")])
    n2 = nodes.nodes["n2"]
    assert [n.id for n in nodes.up()] == ["n1"]
    nodes._mark_up(n2)  # a probe answered: still fenced
    assert not n2.up and n2.describe()["state"] == "dead"
    with pytest.raises(OwnerDown) as err:
        await loc.owner("sbx")
    assert "node n2" in err.value.message and "declared dead by the cluster" in err.value.message
    assert "raylet died" in err.value.message
    apply_records(nodes, [_rec("n2", "dead", 2)])  # the same incarnation: still fenced
    assert n2.fenced is not None
    apply_records(nodes, [_rec("n2", "alive", 3)])  # registered again
    assert n2.fenced is None
    nodes._mark_up(n2)
    assert n2.up


async def test_an_ended_sandbox_without_a_binding_goes_to_the_node_of_its_tombstone() -> None:
    """The binding of a killed sandbox is gone with it: the nodes are asked for a tombstone only (a node
    that runs an unbound sandbox is not given it), so the client hears when and why, as from one node."""
    from typing import Any

    from aenv.gateway.cluster import RedisDirectory
    from aenv.gateway.directory import AskNodes
    from aenv.gateway.nodes import Node

    answers = {"n1": httpx.Response(200, json={"sandboxID": "s"}),
               "n2": httpx.Response(404, json={"code": 404, "reason": "lease_expired", "endedAt": "t"})}  # fmt: skip

    def handler(request: httpx.Request) -> httpx.Response:
        return answers["n1" if request.url.port == 1 else "n2"]

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    nodes = NodeSet([Node("n1", "http://h:1", "h", 1), Node("n2", "http://h:2", "h", 2)], client, None)
    for n in nodes.nodes.values():
        nodes._mark_up(n)

    class Reader:
        async def binding(self, sandbox_id: str) -> Any:
            return None

    directory = RedisDirectory(Reader(), AskNodes(nodes, client, None))  # type: ignore[arg-type]
    assert await directory.find_sandbox("s") == "n2"
    answers["n2"] = httpx.Response(404, json={"code": 404, "message": "not found"})
    assert await directory.find_sandbox("s") is None


async def test_what_was_lost_with_a_dead_node_is_on_its_record(nodes: NodeSet) -> None:
    from aenv.gateway.cluster import Follower
    from aenv.gateway.nodes import LOST_KEPT

    apply_records(nodes, [_rec("n1")])
    loc = Locator(nodes, NoDirectory())
    loc.remember("sbx-0", "n1")
    follower = Follower(None, nodes, loc, 60.0)  # type: ignore[arg-type]  # events only: no reader needed
    for i in range(LOST_KEPT + 5):
        await follower._on_event(f"lost sbx-{i} n1")
    await follower._on_event("lost sbx-x nobody")  # a node this gateway never heard of: ignored
    lost = nodes.nodes["n1"].describe()["lost"]
    assert lost["count"] == LOST_KEPT + 5 and len(lost["sandboxes"]) == LOST_KEPT
    assert lost["sandboxes"][-1] == f"sbx-{LOST_KEPT + 4}"

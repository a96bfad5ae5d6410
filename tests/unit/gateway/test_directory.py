"""The binding cache: hits skip the directory, misses ask it, and the answers name a node that is down."""

from __future__ import annotations

import random

import httpx
import pytest

from aenv.gateway.control import Gateway
from aenv.gateway.directory import Locator, OwnerDown, OwnerUnknown
from aenv.gateway.forward import Forwarder
from aenv.gateway.nodes import Node, NodeSet


class FakeDirectory:
    def __init__(self, bindings: dict[str, str]) -> None:
        self.bindings = bindings
        self.asked: list[str] = []

    async def find_sandbox(self, sandbox_id: str) -> str | None:
        self.asked.append(sandbox_id)
        return self.bindings.get(sandbox_id)

    async def find_snapshot(self, snapshot_id: str) -> str | None:
        self.asked.append(snapshot_id)
        return self.bindings.get(snapshot_id)

    async def published(self, sandbox_id: str) -> bool:
        return self.bindings.get(f"published:{sandbox_id}") == "yes"


@pytest.fixture
def nodes() -> NodeSet:
    ns = NodeSet([Node("n1", "http://h:1", "h", 1), Node("n2", "http://h:2", "h", 2)], httpx.AsyncClient(), None)
    for n in ns.nodes.values():
        n.up = True
    return ns


async def test_a_miss_asks_the_directory_once(nodes: NodeSet) -> None:
    directory = FakeDirectory({"sbx1": "n2"})
    loc = Locator(nodes, directory)
    assert (await loc.owner("sbx1")).id == "n2"
    assert (await loc.owner("sbx1")).id == "n2"
    assert directory.asked == ["sbx1"]


async def test_a_sandbox_on_a_down_node_names_the_node(nodes: NodeSet) -> None:
    loc = Locator(nodes, FakeDirectory({}))
    loc.remember("sbx1", "n2")
    nodes.mark_down(nodes.nodes["n2"], "ConnectError: refused")
    with pytest.raises(OwnerDown) as err:
        await loc.owner("sbx1")
    assert "node n2 (http://h:2)" in err.value.message and "refused" in err.value.message
    with pytest.raises(OwnerUnknown) as unknown:
        await loc.owner("nope")
    assert "down, so not asked: node n2" in unknown.value.message


async def test_the_cache_is_bounded(nodes: NodeSet) -> None:
    loc = Locator(nodes, FakeDirectory({}), max_cached=2)
    for sid in ("a", "b", "c"):
        loc.remember(sid, "n1")
    assert loc.cached("a") is None and loc.cached("c") is not None


def test_placement_skips_down_and_refusing_nodes_and_follows_snapshots(nodes: NodeSet) -> None:
    loc = Locator(nodes, FakeDirectory({}))
    gw = Gateway(nodes, loc, Forwarder(nodes), random.Random(0))
    nodes.nodes["n1"].counts = {"running": 9}
    assert gw.place(set(), None, None) is nodes.nodes["n2"]
    assert gw.place({"n2"}, None, None) is nodes.nodes["n1"]
    loc.remember_snapshot("snap1", "n1")
    assert gw.place(set(), "snap1", None) is nodes.nodes["n1"]  # where the snapshot's files are
    nodes.mark_down(nodes.nodes["n1"], "refused")
    assert gw.place(set(), "snap1", None) is nodes.nodes["n2"]
    assert gw.place({"n2"}, None, None) is None

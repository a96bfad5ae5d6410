"""Volumes in the cluster directory against a real redis-server: bound like sandboxes (fenced by the
node's incarnation), names unique per owner across the nodes, kept by a node declared dead, re-published
by a node at start, and bound by the store before it writes a volume's row."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from aenv.directory import keys
from aenv.directory.node import Fenced, NotAdoptable, mark_dead
from aenv.directory.reader import DirectoryReader
from aenv.errors import Conflict, StoreError
from aenv.store.sqlite import Store
from aenv.store.volumes import READY, VolumeLog, VolumeRow
from tests.unit.directory.test_node import _node


def test_bind_and_unbind_a_volume(client: redis.Redis) -> None:
    d = _node(client)
    d.bind_volume("v1", "own", "data")
    assert keys.strs(client.hgetall(keys.volume_key("v1"))) == {"node": "n1", "incarnation": "1", "owner": "own",
                                                               "name": "data"}  # fmt: skip
    assert client.get(keys.volume_name_key("own", "data")) == "v1"
    assert client.smembers(keys.node_volumes_key("n1")) == {"v1"}
    d.unbind_volume("v1", "own", "data")
    assert not client.exists(keys.volume_key("v1"), keys.volume_name_key("own", "data"))
    assert not client.smembers(keys.node_volumes_key("n1"))


def test_a_name_is_unique_per_owner_across_nodes(client: redis.Redis) -> None:
    a, b = _node(client), _node(client, "n2")
    a.bind_volume("v1", "own", "data")
    with pytest.raises(Conflict, match="a volume named data already exists .volume v1 on node n1"):
        b.bind_volume("v2", "own", "data")
    assert not client.exists(keys.volume_key("v2"))
    b.bind_volume("v3", "other", "data")  # another key's name
    assert client.get(keys.volume_name_key("other", "data")) == "v3"


def test_a_dead_node_keeps_its_volumes_and_cannot_bind(client: redis.Redis) -> None:
    d = _node(client)
    d.bind_volume("v1", "own", "data")
    mark_dead(client, "n1", "raylet gone")
    assert client.hget(keys.volume_key("v1"), "node") == "n1"  # its files are on n1
    with pytest.raises(Fenced):
        d.bind_volume("v2", "own", "more")
    with pytest.raises(Conflict):
        _node(client, "n2").bind_volume("v9", "own", "data")  # the name stays taken while n1 is away


def test_claim_volumes_republishes_and_unbinds_what_is_gone(client: redis.Redis) -> None:
    d = _node(client)
    d.bind_volume("kept", "own", "a")
    d.bind_volume("gone", "own", "b")  # bound, but no longer in the node's store
    client.delete(keys.volume_key("kept"))  # e.g. the directory lost it (soft state)
    _node(client, "n2").bind_volume("elsewhere", "own", "c")
    again = _node(client)
    refused = again.claim_volumes([("kept", "own", "a"), ("elsewhere", "own", "c"), ("clash", "own", "c")])
    assert set(refused) == {"elsewhere", "clash"}
    assert "n2" in refused["elsewhere"] and "already exists" in refused["clash"]
    assert client.hget(keys.volume_key("kept"), "incarnation") == "2"
    assert not client.exists(keys.volume_key("gone"), keys.volume_name_key("own", "b"))


async def test_the_reader_finds_volumes_by_id_and_name(client: redis.Redis, redis_url: str) -> None:
    _node(client, "n2").bind_volume("v1", "own", "data")
    reader = DirectoryReader(redis_url)
    try:
        assert await reader.volume_node("v1") == "n2"
        assert await reader.volume_named("own", "data") == ("v1", "n2")
        assert await reader.volume_node("nope") is None
        assert await reader.volume_named("other", "data") is None
    finally:
        await reader.aclose()


def _vol(vid: str, name: str) -> VolumeRow:
    return VolumeRow(id=vid, name=name, owner="own", token="t", state=READY, created_at=0.0)


def test_the_store_binds_a_volume_before_its_row(client: redis.Redis, tmp_path: Path) -> None:
    store = Store(tmp_path / "a.db", binder=_node(client))
    vols = VolumeLog(store)
    vols.put(_vol("v1", "data"))
    assert client.hget(keys.volume_key("v1"), "node") == "n1"
    other = Store(tmp_path / "b.db", binder=_node(client, "n2"))
    with pytest.raises(Conflict):
        VolumeLog(other).put(_vol("v2", "data"))  # the name is n1's
    assert VolumeLog(other).get("v2") is None
    vols.delete("v1")
    assert not client.exists(keys.volume_key("v1"))
    mark_dead(client, "n1", "test")
    with pytest.raises(StoreError):
        vols.put(_vol("v3", "x"))  # fenced: nothing written
    assert vols.get("v3") is None
    store.close()
    other.close()


def test_a_volume_moves_with_an_adopted_pause_only_from_a_dead_node(client: redis.Redis) -> None:
    a, b, c = _node(client), _node(client, "n2"), _node(client, "n3")
    a.bind_volume("v1", "own", "data")
    with pytest.raises(NotAdoptable, match="node n1 is not declared dead"):
        b.adopt_volume("v1", "own", "data", "n1")
    mark_dead(client, "n1", "raylet gone")
    b.adopt_volume("v1", "own", "data", "n1")
    assert keys.strs(client.hgetall(keys.volume_key("v1")))["node"] == "n2"
    assert client.smembers(keys.node_volumes_key("n2")) == {"v1"} and not client.smembers(keys.node_volumes_key("n1"))
    assert client.get(keys.volume_name_key("own", "data")) == "v1"
    b.adopt_volume("v1", "own", "data", "n1")  # again (a retried adoption): a no-op
    with pytest.raises(NotAdoptable, match="bound to node n2"):
        c.adopt_volume("v1", "own", "data", "n1")  # once: a second adopter finds it moved

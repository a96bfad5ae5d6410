"""The node side of the cluster directory against a real redis-server: bindings, fencing by
incarnation, the controller's mark_dead, and claim at a node's start."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis

from aenv.directory import keys
from aenv.directory.node import DirectoryError, Fenced, NodeDirectory, NotAdoptable, connect, mark_dead
from aenv.directory.reader import DirectoryReader
from aenv.kinds import SandboxState
from aenv.store.sqlite import SandboxRow, Store


def _node(client: redis.Redis, name: str = "n1") -> NodeDirectory:
    d = NodeDirectory(client, name, f"http://10.0.0.1:800{name[-1]}")
    d.register()
    return d


def test_register_bumps_the_incarnation(client: redis.Redis) -> None:
    a = _node(client)
    assert a.incarnation == 1
    assert _node(client).incarnation == 2
    assert client.hget(keys.node_key("n1"), "status") == "alive"


def test_bind_and_unbind(client: redis.Redis) -> None:
    d = _node(client)
    d.bind("sbx1")
    assert keys.strs(client.hgetall(keys.sandbox_key("sbx1"))) == {"node": "n1", "incarnation": "1", "state": "live"}
    assert client.smembers(keys.node_sandboxes_key("n1")) == {"sbx1"}
    d.unbind("sbx1")
    assert not client.exists(keys.sandbox_key("sbx1"))
    assert not client.smembers(keys.node_sandboxes_key("n1"))


def test_a_replaced_incarnation_is_fenced(client: redis.Redis) -> None:
    old = _node(client)
    _node(client)  # the node started again
    with pytest.raises(Fenced, match="incarnation 1 is not current"):
        old.bind("sbx1")
    assert not client.exists(keys.sandbox_key("sbx1"))


def test_mark_dead_loses_the_sandboxes_and_fences_the_node(client: redis.Redis) -> None:
    d = _node(client)
    d.bind("a")
    d.bind("b")
    other = _node(client, "n2")
    other.bind("c")
    assert mark_dead(client, "n1", "raylet gone") == 2
    assert mark_dead(client, "n1", "again") == 0  # idempotent
    assert client.hget(keys.sandbox_key("a"), "state") == "lost"
    assert client.hget(keys.sandbox_key("a"), "reason") == "raylet gone"
    assert client.hget(keys.sandbox_key("c"), "state") == "live"
    with pytest.raises(Fenced):
        d.bind("z")  # a frozen node that thaws cannot take sandboxes
    d.unbind("a")  # refused quietly: the lost binding stays to say where it was lost
    assert client.hget(keys.sandbox_key("a"), "state") == "lost"


def test_claim_keeps_what_is_still_bound_and_refuses_the_rest(client: redis.Redis) -> None:
    d = _node(client)
    d.bind("kept")
    d.bind("lost")
    d.bind("stale")  # bound, but the node's store no longer has it
    client.hset(keys.sandbox_key("lost"), mapping={"state": "lost", "reason": "declared dead"})
    _node(client, "n2").bind("moved")
    again = _node(client)  # restarted: incarnation 2
    refused = again.claim(["kept", "lost", "moved", "never"])
    assert set(refused) == {"lost", "moved", "never"}
    assert "declared dead" in refused["lost"] and "n2" in refused["moved"]
    assert client.hget(keys.sandbox_key("kept"), "incarnation") == "2"
    assert not client.exists(keys.sandbox_key("stale"))


def _row(sid: str) -> SandboxRow:
    return SandboxRow(id=sid, template_id="base", state=SandboxState.STARTING, runtime="ns", started_at=0.0,
                      end_at=1.0, cpu_count=1, memory_mb=512, disk_mb=1024)  # fmt: skip


def test_the_store_binds_before_it_writes_and_refuses_when_fenced(client: redis.Redis, tmp_path: Path) -> None:
    d = _node(client)
    store = Store(tmp_path / "a.db", binder=d)
    store.put_sandbox(_row("s1"))
    assert client.hget(keys.sandbox_key("s1"), "node") == "n1"
    mark_dead(client, "n1", "test")
    with pytest.raises(Fenced):
        store.put_sandbox(_row("s2"))
    assert store.get_sandbox("s2") is None
    store.close()


def test_an_unreachable_directory_is_a_store_error(tmp_path: Path) -> None:
    d = NodeDirectory(connect("redis://127.0.0.1:1"), "n1", "http://x:1")
    with pytest.raises(DirectoryError, match="unreachable"):
        d.register()
    d.close()


async def test_the_reader_sees_nodes_bindings_and_events(client: redis.Redis, redis_url: str) -> None:
    reader = DirectoryReader(redis_url)
    seen: list[str] = []
    got = asyncio.Event()

    async def on_event(line: str) -> None:
        seen.append(line)
        if line.startswith("lost"):
            got.set()

    subscribed = asyncio.Event()

    async def on_reconnect() -> None:
        subscribed.set()

    task = asyncio.create_task(reader.follow(on_event, on_reconnect))
    try:
        await asyncio.wait_for(subscribed.wait(), 10)
        d = _node(client)
        d.bind("x")
        mark_dead(client, "n1", "gone")
        await asyncio.wait_for(got.wait(), 10)
        assert seen[:3] == ["node n1", "bind x n1", "lost x n1"]
        (rec,) = await reader.nodes()
        assert (rec.id, rec.status, rec.reason, rec.incarnation) == ("n1", "dead", "gone", 2)
        b = await reader.binding("x")
        assert b is not None and (b.node, b.state) == ("n1", "lost")
        assert await reader.binding("nope") is None
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await reader.aclose()


# ---- published pauses (core/handover.py) ---------------------------------------------------------
def _published(client: redis.Redis) -> tuple[NodeDirectory, NodeDirectory]:
    """n1 binds sbx1 and publishes its pause; n2 is alive; n1 is declared dead."""
    n1, n2 = _node(client, "n1"), _node(client, "n2")
    n1.bind("sbx1")
    assert n1.publish_pause("sbx1", "snap1", {"access_token": "tok", "cpu_count": 1})
    mark_dead(client, "n1", "raylet gone")
    return n1, n2


def test_a_published_pause_is_adopted_once_by_a_live_node(client: redis.Redis) -> None:
    _, n2 = _published(client)
    pause = n2.published_pause("sbx1")
    assert pause is not None
    assert (pause.node, pause.snapshot_id, pause.row, pause.reason) == ("n1", "snap1", {"access_token": "tok",
                                                                                         "cpu_count": 1}, "raylet gone")
    n2.adopt(pause)
    rec = keys.strs(client.hgetall(keys.sandbox_key("sbx1")))
    assert (rec["node"], rec["state"], rec["incarnation"]) == ("n2", "live", "1") and "paused" not in rec
    assert client.ttl(keys.sandbox_key("sbx1")) == -1  # a live binding again: no expiry
    assert client.smembers(keys.node_sandboxes_key("n2")) == {"sbx1"}
    assert n2.published_pause("sbx1") is None
    n3 = _node(client, "n3")
    with pytest.raises(NotAdoptable, match="live on node n2"):
        n3.adopt(pause)  # a second adopter loses


def test_a_live_or_unpublished_binding_is_not_adoptable(client: redis.Redis) -> None:
    n1, n2 = _node(client, "n1"), _node(client, "n2")
    n1.bind("sbx1")
    n1.publish_pause("sbx1", "snap1", {})
    assert n2.published_pause("sbx1") is None  # its node is alive
    n1.bind("sbx2")
    mark_dead(client, "n1", "gone")
    assert n2.published_pause("sbx2") is None  # lost, nothing published


def test_a_resume_withdraws_the_published_pause(client: redis.Redis) -> None:
    n1, n2 = _node(client, "n1"), _node(client, "n2")
    n1.bind("sbx1")
    n1.publish_pause("sbx1", "snap1", {})
    n1.unpublish_pause("sbx1")
    mark_dead(client, "n1", "gone")
    assert n2.published_pause("sbx1") is None


def test_only_the_owner_publishes_and_a_fenced_node_cannot(client: redis.Redis) -> None:
    n1, n2 = _node(client, "n1"), _node(client, "n2")
    n1.bind("sbx1")
    assert not n2.publish_pause("sbx1", "snap1", {})  # not n2's binding
    mark_dead(client, "n1", "gone")
    with pytest.raises(Fenced):
        n1.publish_pause("sbx1", "snap1", {})


def test_a_failed_adoption_gives_the_binding_back(client: redis.Redis) -> None:
    _, n2 = _published(client)
    pause = n2.published_pause("sbx1")
    assert pause is not None
    n2.adopt(pause)
    n2.unbind("sbx1")  # the start failed: the store forgot the row
    n2.give_back(pause)
    again = n2.published_pause("sbx1")
    assert again is not None and again.node == "n1" and again.snapshot_id == "snap1"
    assert 0 < client.ttl(keys.sandbox_key("sbx1")) <= keys.LOST_TTL


def test_the_old_node_back_disowns_what_was_adopted(client: redis.Redis) -> None:
    _, n2 = _published(client)
    pause = n2.published_pause("sbx1")
    assert pause is not None
    n2.adopt(pause)
    back = _node(client, "n1")
    assert back.claim(["sbx1"]) == {"sbx1": "the cluster directory binds it to node n2"}
    back.unbind("sbx1")  # its copy killed: the new binding stays
    assert client.hget(keys.sandbox_key("sbx1"), "node") == "n2"


def test_a_restarted_node_keeps_its_published_pauses(client: redis.Redis) -> None:
    n1 = _node(client, "n1")
    n1.bind("sbx1")
    n1.publish_pause("sbx1", "snap1", {})
    again = _node(client, "n1")  # the server restarted: its claim binds sbx1 again
    assert again.claim(["sbx1"]) == {}
    assert client.hget(keys.sandbox_key("sbx1"), "incarnation") == "2"
    mark_dead(client, "n1", "gone")
    pause = _node(client, "n2").published_pause("sbx1")
    assert pause is not None and pause.snapshot_id == "snap1"

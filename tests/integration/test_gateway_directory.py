"""The gateway on the cluster directory (Redis), in front of two real ``aenv serve`` nodes (ns) in cluster
mode, with the unmodified E2B SDK: still no Ray (the controller's fence is called directly).

Each node binds its sandboxes in Redis in the same step as its own row; the gateway finds nodes and
bindings there and follows the event stream. A node the directory declares dead gets no creates and its
sandboxes answer 404 naming it, even though it still answers probes; restarted, it registers a new
incarnation and kills what the directory no longer binds to it. Volumes are bound to their node the same
way: the SDK's Volume API works through the gateway, a create that mounts volumes lands on their node,
and a volume on a dead node answers naming it until the node is back. Tests run in file order.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from aenv.cluster.redis_proc import RedisProc
from aenv.directory import keys
from aenv.directory.node import mark_dead
from aenv.testing.gateway import wait_for
from aenv.testing.server import stop_server
from tests.fixtures.directory_cluster import KEY, DirectoryCluster, running
from tests.fixtures.plugin import PushedImages
from tests.fixtures.redis import redis_server  # noqa: F401

pytestmark = pytest.mark.timeout(900)



Cluster = DirectoryCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisProc,  # noqa: F811
            pushed_images: PushedImages) -> Iterator[Cluster]:  # fmt: skip
    with running(Cluster(tmp_path_factory.mktemp("gwdir"), redis_server.url), redis_server, pushed_images) as c:
        yield c


@pytest.fixture(scope="module")
def spread(cluster: Cluster) -> list[Any]:
    from e2b import Sandbox

    return [Sandbox.create("base", timeout=600) for _ in range(2)]


def test_nodes_come_from_the_directory(cluster: Cluster) -> None:
    nodes = httpx.get(cluster.gw + "/nodes", headers=KEY, trust_env=False).json()
    assert [(n["nodeID"], n["url"], n["state"], n["incarnation"]) for n in nodes] == [
        ("n1", cluster.url(0), "up", 1), ("n2", cluster.url(1), "up", 1)]
    info = httpx.get(cluster.url(0) + "/aenv/info", headers=KEY, trust_env=False).json()
    assert info["cluster"] == {"nodeID": "n1", "incarnation": 1}


def test_each_node_binds_its_sandboxes(cluster: Cluster, spread: list[Any]) -> None:
    homes = set()
    for sbx in spread:
        b = cluster.r.hgetall(keys.sandbox_key(sbx.sandbox_id))
        assert b["state"] == "live" and b["incarnation"] == "1"
        assert sbx.sandbox_id in cluster.ids_on(int(b["node"][1:]) - 1)
        homes.add(b["node"])
        assert sbx.commands.run("hostname").stdout.strip() == sbx.sandbox_id
    assert homes == {"n1", "n2"}


def test_fork_children_are_bound_by_the_source_node(cluster: Cluster, spread: list[Any]) -> None:
    src = spread[0]
    home = cluster.r.hget(keys.sandbox_key(src.sandbox_id), "node")
    kids = src.fork(count=2, timeout=300)
    assert all(not isinstance(k, Exception) for k in kids), kids
    for kid in kids:
        assert cluster.r.hget(keys.sandbox_key(kid.sandbox_id), "node") == home
        kid.kill()
        assert not cluster.r.exists(keys.sandbox_key(kid.sandbox_id))  # unbound with its row


def test_a_sandbox_made_on_a_node_is_routed_from_its_binding(cluster: Cluster) -> None:
    from e2b import Sandbox

    made = httpx.post(cluster.url(1) + "/v2/sandboxes", json={"templateID": "base"}, headers=KEY, trust_env=False)
    assert made.status_code == 201, made.text
    sid = made.json()["sandboxID"]
    sbx = Sandbox.connect(sid)
    assert sbx.commands.run("hostname").stdout.strip() == sid
    httpx.delete(f"{cluster.url(1)}/sandboxes/{sid}", headers=KEY, trust_env=False)  # behind the gateway's back
    got = httpx.get(f"{cluster.gw}/sandboxes/{sid}", headers=KEY, trust_env=False)
    assert got.status_code == 404  # the unbind event dropped the gateway's cached binding


def test_while_redis_is_frozen_creates_are_a_503_and_running_sandboxes_work(
    cluster: Cluster, spread: list[Any], redis_server: RedisProc,  # noqa: F811
) -> None:
    """Redis stops answering (SIGSTOP: connections hang, as in a partition): a create binds nothing and
    starts nothing, and says why with a 503 the client may retry; the data plane never asks Redis."""
    before = {i: set(cluster.ids_on(i)) for i in (0, 1)}
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        made = httpx.post(cluster.gw + "/v2/sandboxes", json={"templateID": "base"}, headers=KEY, trust_env=False,
                          timeout=60)  # fmt: skip
        assert made.status_code == 503, made.text
        body = made.json()
        assert body["code"] == 503 and "cluster directory unreachable" in body["message"]
        assert body["reason"] == "store_unavailable" and int(made.headers["Retry-After"]) >= 1
        for sbx in spread:
            assert sbx.commands.run("echo still here").stdout == "still here\n"
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    assert {i: set(cluster.ids_on(i)) for i in (0, 1)} == before  # nothing was left half-made
    from e2b import Sandbox

    sbx = Sandbox.create("base", timeout=300)  # the directory answers again at once
    try:
        assert sbx.commands.run("hostname").stdout.strip() == sbx.sandbox_id
        assert cluster.r.hget(keys.sandbox_key(sbx.sandbox_id), "state") == "live"
    finally:
        sbx.kill()


def test_a_pull_through_the_gateway_reaches_every_node(cluster: Cluster, pushed_images: PushedImages) -> None:
    from e2b import Sandbox

    pushed_images.require("busybox:latest")
    r = httpx.post(cluster.gw + "/aenv/templates/pull", json={"image": "busybox:latest", "name": "bb"}, headers=KEY,
                   trust_env=False, timeout=600)  # fmt: skip
    last = json.loads(r.text.splitlines()[-1])
    assert r.status_code == 200 and sorted(last["nodes"]) == ["n1", "n2"], last
    for i in (0, 1):  # every node has it: a create of it may land anywhere
        made = httpx.post(cluster.url(i) + "/v2/sandboxes", json={"templateID": "bb"}, headers=KEY, trust_env=False)
        assert made.status_code == 201, made.text
        sbx = Sandbox.connect(made.json()["sandboxID"])
        assert "BusyBox" in sbx.commands.run("busybox | head -1").stdout
        sbx.kill()


@pytest.fixture(scope="module")
def vols(cluster: Cluster) -> dict[str, Any]:
    """A volume made through the gateway (wherever placement put it) and one made straight on the other
    node (the gateway finds it from the node's own binding): node id -> Volume."""
    from e2b import Volume

    made = Volume.create(f"gw-{secrets.token_hex(3)}")
    home = cluster.r.hget(keys.volume_key(made.volume_id), "node")
    other = "n2" if home == "n1" else "n1"
    direct = httpx.post(cluster.url(int(other[1:]) - 1) + "/volumes", json={"name": f"nd-{secrets.token_hex(3)}"},
                        headers=KEY, trust_env=False)  # fmt: skip
    assert direct.status_code == 201, direct.text
    assert cluster.r.hget(keys.volume_key(direct.json()["volumeID"]), "node") == other
    return {home: made, other: Volume.connect(direct.json()["volumeID"])}


def test_volumes_through_the_gateway(cluster: Cluster, vols: dict[str, Any]) -> None:
    from e2b import Volume
    from e2b.exceptions import VolumeException

    for node_id, vol in vols.items():
        vol.write_file("/hello.txt", f"from {node_id}")
        assert vol.read_file("/hello.txt") == f"from {node_id}"
        assert Volume.get_info(vol.volume_id).token == vol.token
        got = httpx.get(f"{cluster.gw}/volumes/{vol.volume_id}", headers=KEY, trust_env=False)
        assert got.headers["x-aenv-node"] == node_id
    big = os.urandom(8 << 20)  # streamed through the gateway both ways
    vols["n1"].write_file("/big.bin", big)
    assert vols["n1"].read_file("/big.bin", format="bytes") == big
    assert {v.volume_id for v in Volume.list()} >= {v.volume_id for v in vols.values()}
    for node_id, vol in vols.items():
        with pytest.raises(VolumeException):
            Volume.create(vol.name)  # a name is unique across the nodes
        elsewhere = cluster.url(1 if node_id == "n1" else 0)
        r = httpx.post(elsewhere + "/volumes", json={"name": vol.name}, headers=KEY, trust_env=False)
        assert r.status_code == 409 and node_id in r.text, r.text  # even sent straight to another node


def test_a_create_that_mounts_volumes_lands_on_their_node(cluster: Cluster, vols: dict[str, Any]) -> None:
    from e2b import Sandbox

    for node_id, vol in vols.items():
        sbx = Sandbox.create("base", timeout=300, volume_mounts={"/data": vol})
        try:
            assert cluster.r.hget(keys.sandbox_key(sbx.sandbox_id), "node") == node_id
            assert sbx.commands.run("cat /data/hello.txt").stdout == f"from {node_id}"
        finally:
            sbx.kill()
    with pytest.raises(Exception, match="a sandbox mounts volumes of one node") as err:
        Sandbox.create("base", timeout=300, volume_mounts={"/a": vols["n1"], "/b": vols["n2"]})
    assert "node n1" in str(err.value) and "node n2" in str(err.value)


def test_a_node_declared_dead_gets_no_creates_and_its_sandboxes_name_it(cluster: Cluster, spread: list[Any]) -> None:
    from e2b import Sandbox

    lost = next(s for s in spread if cluster.r.hget(keys.sandbox_key(s.sandbox_id), "node") == "n2")
    alive = next(s for s in spread if s is not lost)
    assert mark_dead(cluster.r, "n2", "test: raylet gone") >= 1  # what the controller does
    wait_for(lambda: cluster.node_state("n2") == "dead", 10)
    got = httpx.get(f"{cluster.gw}/sandboxes/{lost.sandbox_id}", headers=KEY, trust_env=False)
    body = got.json()
    assert (got.status_code, body["reason"], body["node"]) == (404, "node_down", "n2")
    assert "declared dead by the cluster" in body["message"] and "raylet gone" in body["message"]
    with pytest.raises(Exception, match="The sandbox was not found"):
        lost.commands.run("true")
    refused = httpx.get(cluster.gw + "/health", headers={"E2b-Sandbox-Id": lost.sandbox_id, "E2b-Sandbox-Port": "49983"},
                        trust_env=False).json()  # what the SDK was told: E2B's words, the node and why apart
    assert (refused["message"], refused["node"]) == ("The sandbox was not found", "n2")
    assert "declared dead" in refused["detail"]
    assert alive.commands.run("echo still").stdout.strip() == "still"
    fresh = [Sandbox.create("base", timeout=300) for _ in range(3)]
    assert {s.sandbox_id for s in fresh} <= cluster.ids_on(0)
    for sbx in fresh:
        sbx.kill()
    # the node itself is alive but fenced: a create sent straight to it is refused, nothing is kept
    before = cluster.ids_on(1)
    direct = httpx.post(cluster.url(1) + "/v2/sandboxes", json={"templateID": "base"}, headers=KEY, trust_env=False)
    assert direct.status_code >= 500 and "FENCED" in direct.text
    assert cluster.ids_on(1) == before


def test_a_volume_on_a_dead_node_names_it(cluster: Cluster, vols: dict[str, Any]) -> None:
    from e2b import Sandbox

    vol = vols["n2"]
    got = httpx.get(f"{cluster.gw}/volumes/{vol.volume_id}", headers=KEY, trust_env=False)
    assert (got.status_code, got.json()["node"]) == (503, "n2") and "declared dead" in got.json()["message"]
    with pytest.raises(Exception, match="n2"):
        vol.read_file("/hello.txt")
    with pytest.raises(Exception, match="node n2"):
        Sandbox.create("base", timeout=300, volume_mounts={"/data": vol})
    listed = httpx.get(f"{cluster.gw}/volumes", headers=KEY, trust_env=False)
    assert listed.headers["x-aenv-nodes-down"] == "n2"
    assert vols["n1"].read_file("/hello.txt") == "from n1"


def test_a_node_that_comes_back_kills_what_it_no_longer_owns(cluster: Cluster, spread: list[Any]) -> None:
    lost = next(s for s in spread if cluster.r.hget(keys.sandbox_key(s.sandbox_id), "node") == "n2")
    assert lost.sandbox_id in cluster.ids_on(1)
    node = cluster.nodes[1]
    assert node is not None
    stop_server(node)  # sandboxes outlive their server; the new one adopts only what is still its own
    cluster.start_node(1)
    assert lost.sandbox_id not in cluster.ids_on(1)
    gone = httpx.get(f"{cluster.url(1)}/sandboxes/{lost.sandbox_id}", headers=KEY, trust_env=False)
    assert gone.status_code == 404 and "declared dead" in gone.text
    assert cluster.r.hget(keys.node_key("n2"), "incarnation") == "3"  # 1, the fence, this start
    wait_for(lambda: cluster.node_state("n2") == "up", 30)
    got = httpx.get(f"{cluster.gw}/sandboxes/{lost.sandbox_id}", headers=KEY, trust_env=False)
    assert got.status_code == 404


def test_a_volume_comes_back_with_its_node(cluster: Cluster, vols: dict[str, Any]) -> None:
    vol = vols["n2"]
    assert cluster.r.hget(keys.volume_key(vol.volume_id), "incarnation") == "3"  # claimed by the new start
    assert vol.read_file("/hello.txt") == "from n2"

"""``aenv gateway`` in front of two real ``aenv serve`` nodes (ns), driven by the unmodified E2B SDK
pointed at the gateway alone: the fast tier of the many-machines work (no Ray, a static node list).

Creates spread over the nodes, commands, files, PTY and WebSocket go through the gateway, fork lands on
the source's node, lists merge both nodes, and when a node is killed the list still answers, its
sandboxes answer a 404/502 naming it, and creates go to the live node; restarted, it takes creates
again. Which node holds a sandbox is asked of the nodes themselves, never of the gateway; so is which
node holds a volume (with the client's own key: volumes are scoped to it).

The tests share one cluster and run in file order: the node kill comes last.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from aenv.testing.gateway import NodeCluster, sdk_env, start_gateway, stop_gateway, wait_for
from aenv.testing.server import API_KEY, free_port

pytestmark = pytest.mark.timeout(900)

KEY = {"X-API-KEY": API_KEY}
NODE_ENV = {"AENV_API_KEYS": API_KEY, "AENV_POOL_SIZE": "1"}


class Cluster(NodeCluster):
    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp, 2, NODE_ENV)

    def node_of(self, sandbox_id: str) -> int:
        return next(i for i in (0, 1) if sandbox_id in self.ids_on(i))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if os.geteuid() != 0:
        pytest.skip("the ns runtime needs root")
    c = Cluster(tmp_path_factory.mktemp("gateway"))
    try:
        c.start_node(0)
        c.start_node(1)
        c.gateway = start_gateway(c.tmp, [c.url(0), c.url(1)], {"AENV_API_KEYS": API_KEY})
        with sdk_env(c.gw):
            yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def spread(cluster: Cluster) -> list[Any]:
    """Two sandboxes created through the gateway: one on each node."""
    from e2b import Sandbox

    return [Sandbox.create("base", timeout=600) for _ in range(2)]


def test_creates_spread_over_the_nodes(cluster: Cluster, spread: list[Any]) -> None:
    assert {cluster.node_of(s.sandbox_id) for s in spread} == {0, 1}
    for sbx in spread:
        assert sbx.commands.run("hostname").stdout.strip() == sbx.sandbox_id
        sbx.files.write("/home/user/a.txt", f"data of {sbx.sandbox_id}")
        assert sbx.files.read("/home/user/a.txt") == f"data of {sbx.sandbox_id}"
        assert [e.name for e in sbx.files.list("/home/user") if e.name == "a.txt"] == ["a.txt"]


def test_signed_file_urls_through_the_gateway(spread: list[Any]) -> None:
    """With E2B_SANDBOX_URL set the URLs name no sandbox: the gateway knows whose signature it is from the
    envd tokens of the creates it relayed, and sends the request to that sandbox's node."""
    for sbx in spread:
        sbx.files.write("/home/user/signed.txt", f"signed {sbx.sandbox_id}")
        url = sbx.download_url("/home/user/signed.txt")
        assert "signature=" in url and sbx.sandbox_id not in url
        got = httpx.get(url, trust_env=False)
        assert (got.status_code, got.text) == (200, f"signed {sbx.sandbox_id}")
        up = sbx.upload_url("/home/user/uploaded.txt")
        assert httpx.post(up, files={"file": ("u.txt", b"via-url")}, trust_env=False).status_code == 200
        assert sbx.files.read("/home/user/uploaded.txt") == "via-url"
    bad = httpx.get(url.replace("signature=v1_", "signature=v1_x"), trust_env=False)
    assert bad.status_code == 401


def test_pty_and_background_commands(spread: list[Any]) -> None:
    from e2b.sandbox.commands.command_handle import PtySize

    sbx = spread[1]
    buf: list[bytes] = []
    term = sbx.pty.create(PtySize(rows=24, cols=80), timeout=0)
    sbx.pty.send_stdin(term.pid, b"echo pty-$((40+2)); exit\n")
    term.wait(on_pty=buf.append)
    assert b"pty-42" in b"".join(buf)
    handle = sbx.commands.run("sleep 0.2; echo late", background=True)
    assert handle.wait().stdout.strip() == "late"


def test_websocket_through_the_gateway(cluster: Cluster, spread: list[Any]) -> None:
    from websockets.sync.client import connect

    from bench.ws import PORT, start_in_sandbox

    sbx = spread[0]
    start_in_sandbox(sbx, PORT, timeout=120)
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(PORT)}
    with connect(cluster.gw.replace("http", "ws"), additional_headers=headers, proxy=None, open_timeout=60) as ws:
        ws.send("hello")
        assert ws.recv(timeout=30) == "hello"
        ws.send(b"\x00" * 100_000)
        assert ws.recv(timeout=30) == b"\x00" * 100_000
    # The node answered with the domain of the Host the client called: get_host() names the gateway.
    gw_port = int(cluster.gw.rsplit(":", 1)[1])
    host = sbx.get_host(PORT)
    assert host == f"{PORT}-{sbx.sandbox_id}.localhost:{gw_port}"
    sock = socket.create_connection(("127.0.0.1", gw_port), timeout=60)
    with connect(f"ws://{host}/", sock=sock, proxy=None, open_timeout=60) as ws:
        ws.send("by host")
        assert ws.recv(timeout=30) == "by host"


def test_fork_lands_on_the_source_node(cluster: Cluster, spread: list[Any]) -> None:
    src = spread[0]
    src.files.write("/home/user/fork.txt", "before the fork")
    kids = src.fork(count=2, timeout=300)
    assert all(not isinstance(k, Exception) for k in kids), kids
    home = cluster.node_of(src.sandbox_id)
    assert {k.sandbox_id for k in kids} <= cluster.ids_on(home)
    for kid in kids:
        assert kid.files.read("/home/user/fork.txt") == "before the fork"
        assert kid.commands.run("hostname").stdout.strip() == kid.sandbox_id
        kid.kill()


def test_a_create_from_a_snapshot_goes_where_the_snapshot_is(cluster: Cluster, spread: list[Any]) -> None:
    from e2b import Sandbox

    src = spread[1]
    src.files.write("/home/user/snap.txt", "in the snapshot")
    snap = src.create_snapshot()
    kid = Sandbox.create(snap.snapshot_id, timeout=300)
    try:
        assert cluster.node_of(kid.sandbox_id) == cluster.node_of(src.sandbox_id)
        assert kid.files.read("/home/user/snap.txt") == "in the snapshot"
    finally:
        kid.kill()
    got = httpx.get(f"{cluster.gw}/snapshots/{snap.snapshot_id}", headers=KEY, trust_env=False)
    assert got.status_code == 200 and got.headers["x-aenv-node"] == f"n{cluster.node_of(src.sandbox_id) + 1}"
    # a snapshot's template is deleted on the snapshot's node; any other template on every node, which
    # refuses while sandboxes of it run there (both nodes run ``spread``'s)
    assert httpx.delete(f"{cluster.gw}/templates/{snap.snapshot_id}", headers=KEY, trust_env=False).status_code == 204
    refused = httpx.delete(f"{cluster.gw}/templates/base", headers=KEY, trust_env=False)
    assert refused.status_code == 409 and "used by running sandboxes" in refused.json()["message"], refused.text
    for i in (0, 1):
        assert httpx.get(f"{cluster.url(i)}/templates/base", headers=KEY, trust_env=False).status_code == 200


def test_reaping_by_metadata_reaches_every_node(cluster: Cluster) -> None:
    from e2b import Sandbox

    made = [Sandbox.create("base", timeout=300, metadata={"run": "gw-reap"}) for _ in range(2)]
    r = httpx.post(cluster.gw + "/aenv/sandboxes/kill", json={"metadata": {"run": "gw-reap"}}, headers=KEY,
                   trust_env=False)  # fmt: skip
    assert r.status_code == 200, r.text
    assert set(r.json()["killed"]) == {s.sandbox_id for s in made} and r.json()["nodesDown"] == []


def test_a_lease_through_the_gateway_holds_and_ends_sandboxes_on_every_node(cluster: Cluster) -> None:
    """One lease for the cluster: made on both nodes under one ID, its heartbeat counts the sandboxes of
    both, and when the heartbeats stop each node kills its own."""
    from e2b import Sandbox

    made = httpx.post(cluster.gw + "/aenv/leases", json={"ttl": 8, "name": "gw"}, headers=KEY, trust_env=False)
    assert made.status_code == 201 and sorted(made.json()["nodes"]) == ["n1", "n2"], made.text
    lease_id = made.json()["leaseID"]
    for i in (0, 1):  # the node's own view: the same lease
        assert httpx.get(f"{cluster.url(i)}/aenv/leases/{lease_id}", headers=KEY, trust_env=False).status_code == 200
    bound = []
    for _ in range(4):
        bound.append(Sandbox.create("base", timeout=600, metadata={"aenv.lease": lease_id}))
        beat = httpx.post(f"{cluster.gw}/aenv/leases/{lease_id}/heartbeat", headers=KEY, trust_env=False)
    assert beat.status_code == 200 and beat.json()["sandboxes"] == 4, beat.text
    ids = {s.sandbox_id for s in bound}
    assert {cluster.node_of(sid) for sid in ids} == {0, 1}, "four creates by load over two nodes all on one"
    wait_for(lambda: not ids & (cluster.ids_on(0) | cluster.ids_on(1)), 30)  # no heartbeat: both nodes kill theirs
    ended = httpx.get(f"{cluster.gw}/aenv/leases/{lease_id}", headers=KEY, trust_env=False).json()
    assert ended["state"] == "ended" and ended["endReason"] == "expired" and ended["sandboxes"] == 0


def test_volumes_are_found_on_their_node_without_a_directory(cluster: Cluster) -> None:
    from e2b import Sandbox, Volume
    from e2b.exceptions import VolumeException

    made = httpx.post(cluster.url(1) + "/volumes", json={"name": f"st-{secrets.token_hex(3)}"}, headers=KEY,
                      trust_env=False)  # fmt: skip
    assert made.status_code == 201, made.text
    vol = Volume.connect(made.json()["volumeID"])  # made behind the gateway's back: the nodes are asked
    vol.write_file("/v.txt", "on n2")
    assert httpx.get(f"{cluster.gw}/volumes/{vol.volume_id}", headers=KEY, trust_env=False).headers["x-aenv-node"] == "n2"
    assert vol.volume_id in {v.volume_id for v in Volume.list()}
    with pytest.raises(VolumeException):
        Volume.create(vol.name)  # sent to the node that has the name: its 409
    sbx = Sandbox.create("base", timeout=300, volume_mounts={"/v": vol.name})
    try:
        assert cluster.node_of(sbx.sandbox_id) == 1
        assert sbx.commands.run("cat /v/v.txt").stdout == "on n2"
    finally:
        sbx.kill()
    assert Volume.destroy(vol.volume_id) is True


def test_a_build_through_the_gateway_reaches_every_node(cluster: Cluster, tmp_path: Path) -> None:
    """These nodes share no store (each publishes to its own state dir): the build is replayed on each
    node under the same IDs, and a create of it by name or by ID works on either node. With a shared
    store it runs once: test_gateway_build_once.py."""
    from e2b import Sandbox, Template

    (tmp_path / "f.txt").write_text("copied through the gateway\n")
    template = (Template(file_context_path=str(tmp_path)).from_template("base").copy("f.txt", "/srv/f.txt")
                .run_cmd("echo built > /opt/b"))  # fmt: skip
    name = f"gwb-{secrets.token_hex(3)}"
    seen: list[str] = []
    info = Template.build(template, name, cpu_count=1, memory_mb=512, on_build_logs=lambda e: seen.append(str(e)))
    assert seen and Template.exists(name)
    for i in (0, 1):
        for ref in (name, info.template_id):
            made = httpx.post(cluster.url(i) + "/v2/sandboxes", json={"templateID": ref}, headers=KEY, trust_env=False)
            assert made.status_code == 201, made.text
            sbx = Sandbox.connect(made.json()["sandboxID"])
            try:
                assert sbx.commands.run("cat /opt/b /srv/f.txt").stdout == "built\ncopied through the gateway\n"
            finally:
                sbx.kill()


def test_templates_are_read_from_a_node_and_pulled_on_every_node(cluster: Cluster) -> None:
    r = httpx.get(cluster.gw + "/templates", headers=KEY, trust_env=False)
    assert r.status_code == 200 and "base" in {t.get("templateID") for t in r.json()} | {
        a for t in r.json() for a in t.get("aliases", [])}
    # a pull reaches every node; an image no node can fetch is an error naming each
    r = httpx.post(cluster.gw + "/aenv/templates/pull", json={"image": "127.0.0.1:1/nothing:here"}, headers=KEY,
                   trust_env=False, timeout=120)  # fmt: skip
    last = json.loads(r.text.splitlines()[-1])
    assert r.status_code == 200 and "node n1" in last["error"]["message"] and "node n2" in last["error"]["message"]


def test_the_image_cache_and_webhooks_of_every_node_through_the_gateway(cluster: Cluster) -> None:
    """What each node keeps for itself is asked of every node and merged into one node's shape (the
    CLI's ``aenv cache ls`` reads it unchanged)."""
    nodes = {f"n{i + 1}": httpx.get(f"{cluster.url(i)}/aenv/cache", headers=KEY, trust_env=False).json() for i in (0, 1)}
    r = httpx.get(cluster.gw + "/aenv/cache", headers=KEY, trust_env=False)
    assert r.status_code == 200, r.text
    merged = r.json()
    assert sorted(merged["nodes"]) == sorted(nodes) and merged["nodesDown"] == []
    assert merged["usage"]["budget"] == sum(a["usage"]["budget"] for a in nodes.values())
    assert len(merged["entries"]) == sum(len(a["entries"]) for a in nodes.values())
    assert {e["node"] for e in merged["entries"]} <= set(nodes)
    pruned = httpx.post(cluster.gw + "/aenv/cache/prune", headers=KEY, trust_env=False)
    assert pruned.status_code == 200 and sorted(pruned.json()["nodes"]) == sorted(nodes), pruned.text
    hooks = httpx.get(cluster.gw + "/aenv/webhooks/deliveries", headers=KEY, trust_env=False)
    assert hooks.status_code == 200 and isinstance(hooks.json(), list), hooks.text


def test_list_merges_the_nodes_and_nodes_show_load(cluster: Cluster, spread: list[Any]) -> None:
    from e2b import Sandbox

    r = httpx.get(cluster.gw + "/v2/sandboxes", headers=KEY, trust_env=False)
    assert r.status_code == 200 and "x-aenv-nodes-down" not in r.headers
    assert {s["sandboxID"] for s in r.json()} == cluster.ids_on(0) | cluster.ids_on(1)
    assert {s.sandbox_id for s in spread} <= {s.sandbox_id for s in Sandbox.list().next_items()}
    pages = Sandbox.list(limit=1)  # the SDK follows the gateway's X-Next-Token over both nodes
    paged: list[str] = []
    while pages.has_next:
        paged += [s.sandbox_id for s in pages.next_items()]
    assert sorted(paged) == sorted(cluster.ids_on(0) | cluster.ids_on(1))
    nodes = httpx.get(cluster.gw + "/nodes", headers=KEY, trust_env=False).json()
    assert [(n["nodeID"], n["url"], n["state"]) for n in nodes] == [("n1", cluster.url(0), "up"), ("n2", cluster.url(1), "up")]
    wait_for(lambda: httpx.get(cluster.gw + "/nodes/n1", headers=KEY, trust_env=False).json()["sandboxes"].get("running", 0) >= 1)
    assert httpx.get(cluster.gw + "/nodes/n9", headers=KEY, trust_env=False).status_code == 404


def test_a_sandbox_the_gateway_never_saw_is_found_by_asking_the_nodes(cluster: Cluster) -> None:
    from e2b import Sandbox

    made = httpx.post(cluster.url(1) + "/v2/sandboxes", json={"templateID": "base"}, headers=KEY, trust_env=False)
    assert made.status_code == 201, made.text
    sid = made.json()["sandboxID"]
    sbx = Sandbox.connect(sid)  # through the gateway: a miss, then the nodes are asked
    assert sbx.commands.run("hostname").stdout.strip() == sid
    httpx.delete(f"{cluster.url(1)}/sandboxes/{sid}", headers=KEY, trust_env=False)
    got = httpx.get(f"{cluster.gw}/sandboxes/{sid}", headers=KEY, trust_env=False)
    assert (got.status_code, got.json().get("reason"), got.headers["x-aenv-node"]) == (404, "killed", "n2")
    unknown = httpx.get(cluster.gw + "/files", params={"path": "/etc/hostname"}, trust_env=False,
                        headers={"E2b-Sandbox-Id": "nosuchsandbox0000000"})  # fmt: skip
    assert unknown.status_code == 502 and unknown.json()["message"] == "The sandbox was not found"  # E2B's words
    assert "nosuchsandbox0000000' not found" in unknown.json()["detail"]


def test_the_gateway_checks_api_keys(cluster: Cluster) -> None:
    assert httpx.get(cluster.gw + "/v2/sandboxes", trust_env=False).status_code == 401
    assert httpx.get(cluster.gw + "/nodes", headers={"X-API-KEY": "e2b_wrong"}, trust_env=False).status_code == 401
    assert httpx.get(cluster.gw + "/health", trust_env=False).status_code == 200


def test_a_gateway_started_with_a_node_down_serves_the_others(cluster: Cluster) -> None:
    from e2b import Sandbox

    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    (cluster.tmp / "second").mkdir()
    gw = start_gateway(cluster.tmp / "second", [cluster.url(0), nowhere], {"AENV_API_KEYS": API_KEY})
    try:
        nodes = {n["nodeID"]: n for n in httpx.get(gw.url + "/nodes", headers=KEY, trust_env=False).json()}
        assert nodes["n1"]["state"] == "up" and nodes["n2"]["state"] == "down" and nodes["n2"]["reason"]
        sbx = Sandbox.create("base", timeout=120, api_url=gw.url, sandbox_url=gw.url)
        try:
            assert sbx.sandbox_id in cluster.ids_on(0)
            assert sbx.commands.run("echo ok").stdout.strip() == "ok"
        finally:
            sbx.kill()
    finally:
        stop_gateway(gw)


def test_a_dead_node_is_skipped_and_named(cluster: Cluster, spread: list[Any]) -> None:
    from e2b import NotFoundException, Sandbox

    lost = next(s for s in spread if cluster.node_of(s.sandbox_id) == 1)
    alive = next(s for s in spread if s is not lost)
    node = cluster.nodes[1]
    assert node is not None
    os.killpg(node.proc.pid, signal.SIGKILL)  # the node's server dies; its sandboxes stay, unreachable
    node.proc.wait(timeout=30)

    r = httpx.get(cluster.gw + "/v2/sandboxes", headers=KEY, trust_env=False)
    assert r.status_code == 200 and r.headers["x-aenv-nodes-down"] == "n2"
    assert {s["sandboxID"] for s in r.json()} == cluster.ids_on(0)
    got = httpx.get(f"{cluster.gw}/sandboxes/{lost.sandbox_id}", headers=KEY, trust_env=False)
    assert (got.status_code, got.json()["reason"], got.json()["node"]) == (404, "node_down", "n2")
    assert re.search(r"is on node n2 \(http://127\.0\.0\.1:\d+\), which is down since", got.json()["message"])
    for call in (Sandbox.get_info, Sandbox.connect):  # the SDK words these 404s itself
        with pytest.raises(NotFoundException):
            call(lost.sandbox_id)
    with pytest.raises(Exception, match="The sandbox was not found"):
        lost.commands.run("true")
    refused = httpx.get(cluster.gw + "/health", headers={"E2b-Sandbox-Id": lost.sandbox_id, "E2b-Sandbox-Port": "49983"},
                        trust_env=False).json()  # what the SDK was told: E2B's words, the node and why apart
    assert (refused["message"], refused["node"]) == ("The sandbox was not found", "n2") and "down" in refused["detail"]
    assert alive.commands.run("echo still").stdout.strip() == "still"
    assert httpx.get(cluster.gw + "/nodes/n2", headers=KEY, trust_env=False).json()["state"] == "down"

    fresh = [Sandbox.create("base", timeout=300) for _ in range(2)]
    assert {s.sandbox_id for s in fresh} <= cluster.ids_on(0)  # the dead node gets no creates
    for sbx in fresh:
        sbx.kill()

    cluster.start_node(1)  # back on its port and state: it answers health again and adopts its sandbox
    wait_for(lambda: httpx.get(cluster.gw + "/nodes/n2", headers=KEY, trust_env=False).json()["state"] == "up")
    assert lost.commands.run("hostname").stdout.strip() == lost.sandbox_id

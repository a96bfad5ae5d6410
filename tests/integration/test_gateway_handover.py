"""A paused sandbox whose pause is published resumes on another node under the same id when its node dies:
two cluster-mode ``aenv serve`` nodes (ns) sharing a file:// snapshot store, a real redis-server, the
gateway and the unmodified E2B SDK (no Ray: the test fences the dead node as the controller does).

The node's server is killed with SIGKILL (its sandboxes outlive it, frozen, unreachable); ``connect``
through the gateway then runs the sandbox on the other node from its published pause: its files, and
with CRIU its processes and their memory, and the volume it mounts (its data published with the pause,
taken over by the adopting node). The dead node, started again, kills its own stale copy.
A sandbox lost without a published pause still answers the 404 naming its node. Tests run in file order.
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from aenv.cluster.redis_proc import RedisProc
from aenv.directory import keys
from aenv.directory.node import mark_dead
from aenv.testing.gateway import wait_for
from tests.fixtures.criu import CRIU
from tests.fixtures.directory_cluster import KEY, DirectoryCluster, running
from tests.fixtures.plugin import PushedImages
from tests.fixtures.redis import redis_server  # noqa: F401

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(os.environ.get("AENV_TEST_RUNTIME") == "vm", reason="vm pauses are not published: a vm "
                       "snapshot's disk is layered on its node's own template build (runtime/vm/snapshot.py)"),
]


# A process whose state is only in memory: a random secret, served on 127.0.0.1:8080 inside the sandbox.
WORKER = """\
import random, socket
secret = random.random()
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 8080))
srv.listen()
open("/tmp/worker.up", "w").close()
while True:
    c, _ = srv.accept()
    c.sendall(f"{secret}\\n".encode())
    c.close()
"""
ASK = "python3 -c \"import socket; print(socket.create_connection(('127.0.0.1', 8080)).recv(64).decode().strip())\""


class Cluster(DirectoryCluster):
    def __init__(self, tmp: Path, redis_url: str) -> None:
        super().__init__(tmp, redis_url, {"AENV_SNAPSHOT_STORE": f"file://{tmp / 'store'}"})

    def home(self, sandbox_id: str) -> int:
        return int(self.r.hget(keys.sandbox_key(sandbox_id), "node")[1:]) - 1

    def kill_node(self, i: int) -> None:
        """The node's server dies (its sandboxes stay, unreachable) and the cluster declares it dead."""
        node = self.nodes[i]
        assert node is not None
        os.killpg(node.proc.pid, signal.SIGKILL)
        node.proc.wait(timeout=30)
        mark_dead(self.r, f"n{i + 1}", "test: node killed")  # what the controller does when Ray says so
        wait_for(lambda: self.node_state(f"n{i + 1}") == "dead", 10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisProc,  # noqa: F811
            pushed_images: PushedImages) -> Iterator[Cluster]:  # fmt: skip
    with running(Cluster(tmp_path_factory.mktemp("handover"), redis_server.url), redis_server, pushed_images) as c:
        yield c


def test_the_adopt_route_is_authenticated_and_refuses_what_is_not_lost(cluster: Cluster) -> None:
    url = cluster.url(0) + "/aenv/sandboxes/nosuchsandbox0000000/adopt"
    assert httpx.post(url, json={}, trust_env=False).status_code == 401
    got = httpx.post(url, json={}, headers=KEY, trust_env=False)
    assert got.status_code == 404 and "nosuchsandbox0000000" in got.text


@pytest.fixture(scope="module")
def moved(cluster: Cluster) -> dict[str, Any]:
    """A sandbox with a file and an in-memory process, paused (published), its node killed, then
    connected to through the gateway; and a running sandbox on the same node (nothing published)."""
    from e2b import Sandbox, Volume

    vol = Volume.create(f"ho-{secrets.token_hex(3)}")  # on some node; the sandbox lands beside it
    sbx = Sandbox.create("base", timeout=600, volume_mounts={"/data": vol})
    home = cluster.home(sbx.sandbox_id)
    sbx.files.write("/data/vol.txt", "the volume came along")
    made = httpx.post(cluster.url(home) + "/v2/sandboxes", json={"templateID": "base"}, headers=KEY, trust_env=False)
    assert made.status_code == 201, made.text
    sbx.files.write("/home/user/kept.txt", "the files came along")
    sbx.files.write("/tmp/worker.py", WORKER)
    sbx.commands.run("python3 /tmp/worker.py", background=True)
    wait_for(lambda: sbx.files.exists("/tmp/worker.up"), 30)
    secret = sbx.commands.run(ASK).stdout.strip()
    second = httpx.post(cluster.url(home) + "/v2/sandboxes", json={"templateID": "base"}, headers=KEY,
                        trust_env=False).json()["sandboxID"]  # fmt: skip
    assert httpx.post(f"{cluster.gw}/sandboxes/{second}/pause", headers=KEY, trust_env=False).status_code == 204
    t_pause = time.monotonic()
    sbx.pause()
    for sid in (sbx.sandbox_id, second):
        wait_for(lambda sid=sid: bool(cluster.r.hget(keys.sandbox_key(sid), "paused")), 120)  # the upload finished
    t0 = time.monotonic()
    cluster.kill_node(home)
    t1 = time.monotonic()
    back = Sandbox.connect(sbx.sandbox_id, timeout=600)
    t2 = time.monotonic()
    return {"sbx": sbx, "back": back, "home": home, "secret": secret, "running": made.json()["sandboxID"], "second": second,
            "vol": vol,
            "timings": f"pause -> published {t0 - t_pause:.2f}s; node killed -> fenced {t1 - t0:.2f}s; "
                       f"connect (adopted elsewhere) {t2 - t1:.2f}s; death -> resumed elsewhere {t2 - t0:.2f}s"}


def test_a_published_pause_resumes_on_another_node_under_its_id(cluster: Cluster, moved: dict[str, Any]) -> None:
    back, sid = moved["back"], moved["sbx"].sandbox_id
    other = 1 - moved["home"]
    assert back.sandbox_id == sid
    binding = cluster.r.hgetall(keys.sandbox_key(sid))
    assert binding["node"] == f"n{other + 1}" and binding["state"] == "live" and "paused" not in binding
    assert sid in cluster.ids_on(other)
    assert back.commands.run("hostname").stdout.strip() == sid
    assert back.files.read("/home/user/kept.txt") == "the files came along"
    assert moved["sbx"].commands.run("echo same token").stdout.strip() == "same token"  # the old handle works on


def test_its_volume_moved_with_it(cluster: Cluster, moved: dict[str, Any]) -> None:
    """The volume's data travelled with the published pause: the adopting node holds the volume now
    (same ID, name and token), bound to it in the directory, mounted where it was."""
    vol, other = moved["vol"], 1 - moved["home"]
    assert moved["back"].commands.run("cat /data/vol.txt").stdout == "the volume came along"
    assert cluster.r.hget(keys.volume_key(vol.volume_id), "node") == f"n{other + 1}"
    assert vol.read_file("/vol.txt") == "the volume came along"  # through the gateway, on its new node
    got = httpx.get(f"{cluster.gw}/volumes/{vol.volume_id}", headers=KEY, trust_env=False)
    assert got.status_code == 200 and got.headers["x-aenv-node"] == f"n{other + 1}", got.text


@pytest.mark.skipif(not CRIU.usable, reason=f"process snapshots need CRIU >= 4.2 ({CRIU.reason})")
def test_its_processes_and_their_memory_came_along(moved: dict[str, Any]) -> None:
    assert moved["back"].commands.run(ASK).stdout.strip() == moved["secret"]


def test_the_old_resume_route_adopts_too(cluster: Cluster, moved: dict[str, Any]) -> None:
    got = httpx.post(f"{cluster.gw}/sandboxes/{moved['second']}/resume", json={"timeout": 300}, headers=KEY,
                     trust_env=False, timeout=120)  # fmt: skip
    assert got.status_code == 201, got.text
    assert got.json()["sandboxID"] == moved["second"]
    assert cluster.r.hget(keys.sandbox_key(moved["second"]), "node") == f"n{2 - moved['home']}"
    again = httpx.post(f"{cluster.gw}/sandboxes/{moved['second']}/connect", json={"timeout": 300}, headers=KEY,
                       trust_env=False)  # fmt: skip
    assert again.status_code == 200  # running on its new node: a plain connect
    httpx.delete(f"{cluster.gw}/sandboxes/{moved['second']}", headers=KEY, trust_env=False)


def test_without_a_published_pause_the_404_names_the_lost_node(cluster: Cluster, moved: dict[str, Any]) -> None:
    got = httpx.post(f"{cluster.gw}/sandboxes/{moved['running']}/connect", json={"timeout": 60}, headers=KEY,
                     trust_env=False)  # fmt: skip
    body = got.json()
    assert (got.status_code, body["reason"], body["node"]) == (404, "node_down", f"n{moved['home'] + 1}")
    assert "declared dead by the cluster" in body["message"]


def test_the_dead_node_back_kills_its_stale_copy(cluster: Cluster, moved: dict[str, Any]) -> None:
    home, sid = moved["home"], moved["sbx"].sandbox_id
    cluster.start_node(home)
    assert sid not in cluster.ids_on(home)
    wait_for(lambda: cluster.node_state(f"n{home + 1}") == "up", 30)
    assert cluster.r.hget(keys.sandbox_key(sid), "node") == f"n{2 - home}"
    assert moved["back"].commands.run("cat /home/user/kept.txt").stdout == "the files came along"
    print(moved["timings"])


def test_a_kill_of_the_moved_sandbox_takes_its_pause_out_of_the_store(cluster: Cluster, moved: dict[str, Any]) -> None:
    manifests = cluster.tmp / "store" / "manifests"
    assert [p.name for p in manifests.iterdir()]  # the published pause
    other = 1 - moved["home"]
    listed = httpx.get(cluster.url(other) + "/snapshots", headers=KEY, trust_env=False).json()
    assert any(s.get("sandboxID") == moved["sbx"].sandbox_id for s in listed), listed
    moved["back"].kill()
    wait_for(lambda: not list(manifests.iterdir()), 30)
    listed = httpx.get(cluster.url(other) + "/snapshots", headers=KEY, trust_env=False).json()
    assert not any(s.get("sandboxID") == moved["sbx"].sandbox_id for s in listed), listed

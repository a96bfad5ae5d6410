"""The ``cluster`` tier: ``aenv cluster local`` for real — Redis, a Ray head, three Ray nodes each in its
own network namespace with its ``aenv serve`` started by its node agent, the controller, the gateway —
driven by the unmodified E2B SDK through the gateway alone.

Creates spread over the nodes, fork x16 stays on the source's node, killing a node agent leaves its
server and sandboxes alone (the restarted agent adopts them), and a node whose machine dies is
declared dead by Ray, fenced by the controller: its sandboxes answer 404 naming it and no create goes
there. Only addresses inside the namespaces the cluster made are targets. Slow (Ray start-up): marked
``cluster`` and ``slow``; skips where Ray, Redis, root or network namespaces are missing. Tests run in
file order: the node kill comes last.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from aenv.directory import keys
from aenv.testing.gateway import sdk_env, wait_for
from aenv.testing.server import API_KEY, free_port

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(1500)]

KEY = {"X-API-KEY": API_KEY}
NODES = ("n1", "n2", "n3")


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces and the ns runtime need root"
    if importlib.util.find_spec("ray") is None:
        return "Ray is not installed (pip install 'aenv[cluster]')"
    for tool in ("redis-server", "ip", "nsenter", "setsid"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return None


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    if (why := _missing()) is not None:
        pytest.skip(why)
    from aenv.cluster.local import LocalCluster

    port = free_port()
    c = LocalCluster(3, port, Path(f"/tmp/aenvc{port}"), "10.213.7.0/24",
                     {"AENV_API_KEYS": API_KEY, "AENV_POOL_SIZE": "1"})  # fmt: skip
    try:
        c.start(timeout=600)
        c.r = redis.Redis.from_url(c.redis.url, decode_responses=True)
        with sdk_env(c.url):
            yield c
    finally:
        if getattr(c, "r", None) is not None:
            c.r.close()
        c.close()
    assert not Path(f"/run/netns/{c.topo.ns(0)}").exists() and not c.root.exists()


def _node_of(c: Any, sandbox_id: str) -> str:
    return str(c.r.hget(keys.sandbox_key(sandbox_id), "node"))


def _driver(c: Any, code: str) -> Any:
    """A Ray driver in a subprocess (Ray's own logging and warnings stay out of this test process)."""
    script = ("import json, ray, sys\nray.init(address=sys.argv[1], namespace='aenv', logging_level='error', "
              "log_to_driver=False)\n" + code)  # fmt: skip
    out = subprocess.run([sys.executable, "-c", script, c.gcs], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(next(ln for ln in reversed(out.stdout.splitlines()) if ln.startswith(("{", "["))))


@pytest.fixture(scope="module")
def spread(cluster: Any) -> list[Any]:
    from e2b import Sandbox

    return [Sandbox.create("base", timeout=900) for _ in range(6)]


def test_every_node_is_up_with_its_agent(cluster: Any) -> None:
    nodes = httpx.get(cluster.url + "/nodes", headers=KEY, trust_env=False).json()
    assert sorted((n["nodeID"], n["state"], n["url"]) for n in nodes) == [
        (name, "up", f"http://10.213.7.{11 + i}:8000") for i, name in enumerate(NODES)]
    got = _driver(cluster, "print(json.dumps(ray.get(ray.get_actor('aenv-controller').status.remote())))")
    assert sorted(got["nodes"]) == list(NODES)
    for name in NODES:
        agent = got["nodes"][name]["agent"]
        assert agent["healthy"] and agent["how"] == "started", agent


def test_creates_spread_over_the_nodes(cluster: Any, spread: list[Any]) -> None:
    assert {_node_of(cluster, s.sandbox_id) for s in spread} == set(NODES)
    for sbx in spread:
        assert sbx.commands.run("hostname").stdout.strip() == sbx.sandbox_id


def test_fork_16_stays_on_the_source_node(cluster: Any, spread: list[Any]) -> None:
    src = spread[0]
    src.files.write("/home/user/f.txt", "before the fork")
    kids = src.fork(count=16, timeout=600)
    try:
        assert all(not isinstance(k, Exception) for k in kids), [k for k in kids if isinstance(k, Exception)]
        home = _node_of(cluster, src.sandbox_id)
        assert {_node_of(cluster, k.sandbox_id) for k in kids} == {home}
        for kid in kids:
            assert kid.files.read("/home/user/f.txt") == "before the fork"
    finally:
        for kid in kids:
            if not isinstance(kid, Exception):
                kid.kill()


def test_killing_a_node_agent_leaves_its_server_and_sandboxes(cluster: Any, spread: list[Any]) -> None:
    pid = cluster.serve_pid(0)
    code = ("h = [a for a in ray.util.list_named_actors(all_namespaces=True) if a['name'].startswith('aenv-agent-n1-')]\n"
            "actor = ray.get_actor(h[0]['name'], namespace='aenv')\n"
            "ray.kill(actor, no_restart=False)\n"  # the worker dies; Ray restarts the actor on the same node
            "import time\n"
            "for _ in range(600):\n"
            "    try:\n"
            "        print(json.dumps(ray.get(actor.status.remote(), timeout=5))); break\n"
            "    except Exception:\n"
            "        time.sleep(0.2)\n")  # fmt: skip
    after = _driver(cluster, code)
    assert after["pid"] == pid and after["how"] == "adopted" and after["healthy"]
    for sbx in spread:
        if _node_of(cluster, sbx.sandbox_id) == "n1":
            assert sbx.commands.run("echo alive").stdout.strip() == "alive"


def test_a_head_restart_leaves_the_data_plane_and_the_agents(cluster: Any, spread: list[Any]) -> None:
    """The head dies (GCS, its raylet, whatever ran there) and comes back on the same Redis: sandboxes
    answer throughout, creates go on, and the GCS recovers the controller and agents from Redis."""
    from e2b import Sandbox

    pids = [cluster.serve_pid(i) for i in range(3)]
    with cluster.head_down():
        for sbx in spread:
            assert sbx.commands.run("echo during").stdout.strip() == "during"
        made = Sandbox.create("base", timeout=120)
        made.kill()
    status = _driver(cluster, "import time\n"
                     "for _ in range(300):\n"
                     "    try:\n"
                     "        got = ray.get(ray.get_actor('aenv-controller').status.remote(), timeout=5)\n"
                     "        if len(got['nodes']) == 3 and all(isinstance(n['agent'], dict) for n in got['nodes'].values()):\n"
                     "            break\n"
                     "    except Exception:\n"
                     "        pass\n"
                     "    time.sleep(0.5)\n"
                     "print(json.dumps(got))\n")  # fmt: skip
    assert sorted(status["nodes"]) == list(NODES)
    assert [status["nodes"][n]["agent"]["pid"] for n in NODES] == pids  # the same servers, never restarted
    assert [cluster.serve_pid(i) for i in range(3)] == pids
    assert all(n["state"] == "up" for n in httpx.get(cluster.url + "/nodes", headers=KEY, trust_env=False).json())


def test_a_gateway_restart_finds_every_binding_again(cluster: Any, spread: list[Any]) -> None:
    from aenv.cluster.procs import stop_process

    assert cluster.gateway is not None
    stop_process(cluster.gateway)
    cluster.start_gateway()
    wait_for(lambda: _nodes_up(cluster) == set(NODES), 60)
    for sbx in spread:  # no create went through this gateway: the bindings come from Redis
        assert sbx.commands.run("hostname").stdout.strip() == sbx.sandbox_id


def _nodes_up(c: Any) -> set[str]:
    try:
        got = httpx.get(c.url + "/nodes", headers=KEY, trust_env=False).json()
    except httpx.HTTPError:
        return set()
    return {n["nodeID"] for n in got if n["state"] == "up"}


def test_a_dead_node_is_fenced_named_and_skipped(cluster: Any, spread: list[Any]) -> None:
    from e2b import Sandbox

    lost = [s for s in spread if _node_of(cluster, s.sandbox_id) == "n2"]
    alive = [s for s in spread if _node_of(cluster, s.sandbox_id) != "n2"]
    assert lost and alive
    paused = lost[0]  # paused with its pause published (the nodes share a store): it resumes elsewhere
    paused.files.write("/home/user/kept.txt", "moved")
    paused.pause()
    wait_for(lambda: bool(cluster.r.hget(keys.sandbox_key(paused.sandbox_id), "paused")), 120)
    t0 = time.monotonic()
    cluster.kill_node(1)  # n2's Ray processes and its server, SIGKILLed
    wait_for(lambda: cluster.r.hget(keys.node_key("n2"), "status") == "dead", 120)
    print(f"\nnode n2 killed -> declared dead and its sandboxes lost in {time.monotonic() - t0:.1f} s")
    for sbx in lost:
        assert cluster.r.hget(keys.sandbox_key(sbx.sandbox_id), "state") == "lost"
        got = httpx.get(f"{cluster.url}/sandboxes/{sbx.sandbox_id}", headers=KEY, trust_env=False)
        body = got.json()
        assert (got.status_code, body["reason"], body["node"]) == (404, "node_down", "n2")
        assert "declared dead by the cluster" in body["message"] and "Ray declared node n2 dead" in body["message"]
    assert httpx.get(cluster.url + "/nodes/n2", headers=KEY, trust_env=False).json()["state"] == "dead"
    fresh = [Sandbox.create("base", timeout=300) for _ in range(4)]
    try:
        assert {_node_of(cluster, s.sandbox_id) for s in fresh} <= {"n1", "n3"}
    finally:
        for sbx in fresh:
            sbx.kill()
    for sbx in alive:
        assert sbx.commands.run("echo still").stdout.strip() == "still"
    r = httpx.get(cluster.url + "/v2/sandboxes", headers=KEY, trust_env=False)
    assert r.status_code == 200 and r.headers["x-aenv-nodes-down"] == "n2"
    back = Sandbox.connect(paused.sandbox_id, timeout=900)  # adopted by a live node under the same id
    assert _node_of(cluster, paused.sandbox_id) in {"n1", "n3"}
    assert back.files.read("/home/user/kept.txt") == "moved"
    assert back.commands.run("hostname").stdout.strip() == paused.sandbox_id


def test_a_partitioned_node_is_fenced_and_on_rejoining_kills_what_it_lost(cluster: Any, spread: list[Any]) -> None:
    """n3 cut off (its veth down) → declared dead, fenced; healed and its Ray node started again → a new
    agent, which restarts the fenced server: a new incarnation that kills the sandboxes it lost."""
    from e2b import Sandbox

    mine = [s for s in spread if _node_of(cluster, s.sandbox_id) == "n3"]
    assert mine
    inc = int(cluster.r.hget(keys.node_key("n3"), "incarnation"))
    pid = cluster.serve_pid(2)
    cluster.topo.cut(2)
    try:
        wait_for(lambda: cluster.r.hget(keys.node_key("n3"), "status") == "dead", 120)
    finally:
        cluster.topo.heal(2)
    assert all(cluster.r.hget(keys.sandbox_key(s.sandbox_id), "state") == "lost" for s in mine)
    cluster.rejoin_node(2)
    wait_for(lambda: cluster.r.hget(keys.node_key("n3"), "status") == "alive", 300)
    assert int(cluster.r.hget(keys.node_key("n3"), "incarnation")) == inc + 2  # the fence, then the new start
    assert cluster.serve_pid(2) != pid  # the fenced server was restarted, not adopted
    wait_for(lambda: "n3" in _nodes_up(cluster), 60)
    assert not {s.sandbox_id for s in mine} & {x["sandboxID"] for x in httpx.get(
        cluster.node_url(2) + "/v2/sandboxes", headers=KEY, trust_env=False).json()}  # killed on rejoining
    got = httpx.get(f"{cluster.url}/sandboxes/{mine[0].sandbox_id}", headers=KEY, trust_env=False)
    assert got.status_code == 404
    landed = set()
    for _ in range(6):
        sbx = Sandbox.create("base", timeout=120)
        landed.add(_node_of(cluster, sbx.sandbox_id))
        sbx.kill()
    assert "n3" in landed and "n2" not in landed


def test_the_command_prints_its_url_and_removes_everything_on_sigterm(cluster: Any) -> None:
    """``aenv cluster local`` itself (one node, its own subnet), next to the module's cluster."""
    import signal

    port = free_port()
    env = {**os.environ, "AENV_API_KEYS": API_KEY, "AENV_POOL_SIZE": "1"}
    argv = [sys.executable, "-m", "aenv.cli.main", "cluster", "local", "--nodes", "1", "--port", str(port),
            "--subnet", "10.213.8.0/24"]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == f"http://127.0.0.1:{port}"  # printed once every node is up
        nodes = httpx.get(f"http://127.0.0.1:{port}/nodes", headers=KEY, trust_env=False).json()
        assert [(n["nodeID"], n["state"]) for n in nodes] == [("n1", "up")]
        assert Path(f"/run/netns/aenv-{port}-n1").exists()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert not Path(f"/run/netns/aenv-{port}-n1").exists()
    assert not Path(f"/tmp/aenvc{port}").exists()
    assert subprocess.run(["ip", "link", "show", f"aenvbr{port}"], capture_output=True).returncode != 0

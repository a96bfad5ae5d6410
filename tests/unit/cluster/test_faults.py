"""The faults ``LocalCluster`` injects for the chaos run (``bench/chaos.py``): which processes make up one
node's machine, and a Redis restart that keeps its address and its data."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from aenv.cluster.local import LocalCluster
from aenv.cluster.procs import kill_all, machine_pids
from aenv.cluster.redis_proc import start_redis


def _wait_pids(path: Path, n: int) -> list[int]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        got = path.read_text().split() if path.exists() else []
        if len(got) >= n:
            return [int(p) for p in got]
        time.sleep(0.05)
    raise AssertionError(f"{path}: fewer than {n} pids")


def test_a_machine_is_its_servers_descendants_and_what_names_its_directory(tmp_path: Path) -> None:
    """The server's children and grandchildren (a sandbox that double-forked away from it is found by its
    cgroup or, as here, by its command line naming the node's directory); nothing else."""
    pids = tmp_path / "pids"
    tree = f"sleep 300 & echo $! >> {pids}; (sleep 301 & echo $! >> {pids}; wait) & wait"
    server = subprocess.Popen(["sh", "-c", tree])
    node_dir = tmp_path / "n2"
    node_dir.mkdir()
    away = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", f"{node_dir}/state/sbx"],
                            start_new_session=True)  # fmt: skip
    other = subprocess.Popen(["sleep", "302"])
    try:
        kids = _wait_pids(pids, 2)
        found = machine_pids(server.pid, "/aenv/no-such-scope/", f"{node_dir}/")
        assert {server.pid, *kids, away.pid} <= found
        assert other.pid not in found
        kill_all(found)
        assert server.wait(timeout=10) == -9 and away.wait(timeout=10) == -9
        assert other.poll() is None
    finally:
        for p in (server, away, other):
            p.kill()
            p.wait()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_a_redis_restart_keeps_its_address_and_data(tmp_path: Path) -> None:
    c = LocalCluster(1, 18998, tmp_path / "c")
    c.redis = start_redis(tmp_path / "redis")
    try:
        before = c.redis.url
        r = redis.Redis.from_url(before, decode_responses=True)
        r.hset("aenv:sbx:x", mapping={"node": "n1", "state": "live"})
        r.close()
        pid = c.redis.proc.pid
        c.restart_redis(down=0.1)
        assert c.redis.url == before and c.redis.proc.pid != pid
        r = redis.Redis.from_url(before, decode_responses=True)
        assert r.hgetall("aenv:sbx:x") == {"node": "n1", "state": "live"}
        r.close()
    finally:
        c.redis.stop()

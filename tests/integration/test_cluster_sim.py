"""The cluster simulation's pieces together: a real Redis, 10 simulated nodes (``aenv.testing.simnode``) and
one real ``aenv gateway --redis``: creates spread over the nodes, and a killed node is noticed, fenced and
let back in with its new incarnation. Skipped where redis-server is not installed."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from aenv.testing.server import API_KEY
from bench.cluster_sim import SimCluster, creates

KEY = {"X-API-KEY": API_KEY}


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[tuple[SimCluster, str]]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    c = SimCluster(tmp_path, 10)
    try:
        c.start()
        yield c, c.gateways(1)[0]
    finally:
        c.close()


def _state(gw: str, node: str) -> str:
    return str(httpx.get(f"{gw}/nodes/{node}", headers=KEY, trust_env=False).json()["state"])


def test_creates_spread_and_a_killed_node_is_fenced(sim: tuple[SimCluster, str]) -> None:
    c, gw = sim
    load = creates([gw], 4, 1.5, seed=1)
    assert load.ok >= 10 and not load.failed
    on = {n["id"]: n["creates"] for n in c.stats()["nodes"]}
    assert sum(1 for v in on.values() if v) >= 5  # best of 3 spreads them
    victim = max(on, key=lambda k: on[k])
    sid = next(s for s in load.ids if httpx.get(f"{gw}/sandboxes/{s}", headers=KEY, trust_env=False)
               .headers.get("x-aenv-node") == victim)  # fmt: skip
    c.admin_call("kill", node=victim)
    deadline = time.monotonic() + 20
    while _state(gw, victim) != "dead":
        assert time.monotonic() < deadline, "the killed node was never fenced"
        time.sleep(0.05)
    got = httpx.get(f"{gw}/sandboxes/{sid}", headers=KEY, trust_env=False)
    assert got.status_code == 404 and "declared dead" in got.text
    assert creates([gw], 2, 0.5, seed=2).ok > 0  # the others still take creates
    c.admin_call("revive", node=victim)
    deadline = time.monotonic() + 20
    while _state(gw, victim) != "up":
        assert time.monotonic() < deadline, "the revived node never came back"
        time.sleep(0.05)

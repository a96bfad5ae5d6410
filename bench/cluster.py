"""``aenv cluster local`` measured: creates/s through the gateway with 1 and with 3 nodes, the time from a
node's death to its sandboxes reported lost and to its published pause resumed on another node, and what Redis, Ray, the gateway and each node's server
cost in memory (PSS: shared pages split between the processes that map them, so the sum is honest).

On one 2-core machine every node shares the same CPUs: creates/s with 3 nodes against 1 measures the
routing and the extra processes, not more capacity. Not in ``all`` (each cluster takes ~30 s to
start and needs Ray, root and network namespaces): ``python -m bench --scenarios cluster``.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import time
from pathlib import Path
from typing import Any

import httpx

from aenv.testing.server import API_KEY, free_port
from bench.context import Ctx
from bench.rows import ms_since, row, scenario, value_row

KEY = {"X-API-KEY": API_KEY}


def _pss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _pids_naming(marker: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    out.append(int(d.name))
            except OSError:
                continue
    return out


def _footprint(c: Any) -> dict[str, float]:
    """PSS in MB by role: Ray head, each Ray node (raylet, its agents and workers), each node's server,
    Redis, the gateway."""
    assert c.redis is not None and c.gateway is not None
    out = {"Ray head (GCS, raylet, monitors)": sum(_pss_mb(p) for p in _pids_naming(str(c.root / "ray-head")))}
    out["Ray node (ray start, raylet, agent actor)"] = sum(
        _pss_mb(p) for p in _pids_naming(str(c.root / "ray-n1")) + [c.ray_node_proc(0).pid])
    out["Redis"] = _pss_mb(c.redis.proc.pid)
    out["gateway"] = _pss_mb(c.gateway.pid)
    pid = c.serve_pid(0)
    out["aenv serve (one node, no sandboxes)"] = _pss_mb(pid) if pid else 0.0
    return out


def _creates_per_s(url: str, total: int, workers: int) -> tuple[float, list[float], dict[str, int]]:
    from e2b import Sandbox

    def one(_: int) -> tuple[float, str]:
        t0 = time.perf_counter()
        sbx = Sandbox.create("base", timeout=300, api_url=url, sandbox_url=url)
        took = ms_since(t0)
        node = httpx.get(f"{url}/sandboxes/{sbx.sandbox_id}", headers=KEY, trust_env=False).headers["x-aenv-node"]
        sbx.kill()
        return took, node

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        got = list(pool.map(one, range(total)))
    rate = total / (time.perf_counter() - t0)
    spread: dict[str, int] = {}
    for _, node in got:
        spread[node] = spread.get(node, 0) + 1
    return rate, [t for t, _ in got], spread


def cluster_local(ctx: Ctx) -> dict[str, Any]:
    """1 node, then 3: start, creates/s, footprint; on 3, a node killed (time to "lost"), then another (time
    until its published pause runs elsewhere)."""
    from aenv.cluster.local import LocalCluster

    missing = _missing()
    if missing:
        return scenario("aenv cluster local", [], [f"skipped: {missing}"])
    rows, notes = [], []
    total, workers = ctx.n(6, 30), 3
    for n, subnet in ((1, "10.213.9.0/24"), (3, "10.213.10.0/24")):
        port = free_port()
        c = LocalCluster(n, port, Path(f"/tmp/aenvc{port}"), subnet, {"AENV_API_KEYS": API_KEY, "AENV_POOL_SIZE": "2"})
        t0 = time.perf_counter()
        c.start(timeout=600)
        try:
            system = f"{ctx.system} cluster ×{n}"
            rows.append(value_row("cluster local: start → every node up", system, ms_since(t0), 1, "ms"))
            rate, lat, spread = _creates_per_s(c.url, total, workers)
            rows.append(value_row(f"creates/s through the gateway ({workers} clients)", system, rate, total, "/s"))
            rows.append(row("create through the gateway", system, lat))
            notes.append(f"×{n}: creates per node {dict(sorted(spread.items()))}")
            if n == 3:
                for role, mb in _footprint(c).items():
                    rows.append(value_row(f"memory (PSS): {role}", f"{ctx.system} cluster", mb, 1, "MB"))
                rows.append(value_row("node killed → its sandboxes reported lost", system, _death(c), 1, "ms"))
                rows.append(value_row("node killed → its published pause resumed on another node", system,
                                      _pause_moves(c), 1, "ms"))  # fmt: skip
        finally:
            c.close()
    notes.append("one 2-core machine: the nodes share its CPUs, so 3 nodes against 1 is routing overhead, not capacity")
    notes.append("Ray health checks tightened for one machine: 500 ms period, 1 s timeout, 3 failures")
    return scenario("aenv cluster local (Redis, Ray, nodes in network namespaces, gateway)", rows, notes)


def _death(c: Any) -> float:
    from e2b import Sandbox

    sbx = None
    for _ in range(12):  # a sandbox on n3, the node that dies
        cand = Sandbox.create("base", timeout=300, api_url=c.url, sandbox_url=c.url)
        node = httpx.get(f"{c.url}/sandboxes/{cand.sandbox_id}", headers=KEY, trust_env=False).headers["x-aenv-node"]
        if node == "n3":
            sbx = cand
            break
        cand.kill()
    if sbx is None:
        raise RuntimeError("no create landed on n3")
    t0 = time.perf_counter()
    c.kill_node(2)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        got = httpx.get(f"{c.url}/sandboxes/{sbx.sandbox_id}", headers=KEY, trust_env=False)
        if got.status_code == 404 and "declared dead" in got.text:
            return ms_since(t0)
        time.sleep(0.05)
    raise RuntimeError("the dead node's sandbox was never reported lost")


def _on_node(c: Any, node_id: str) -> Any:
    from e2b import Sandbox

    for _ in range(12):
        cand = Sandbox.create("base", timeout=300, api_url=c.url, sandbox_url=c.url)
        node = httpx.get(f"{c.url}/sandboxes/{cand.sandbox_id}", headers=KEY, trust_env=False).headers["x-aenv-node"]
        if node == node_id:
            return cand
        cand.kill()
    raise RuntimeError(f"no create landed on {node_id}")


def _pause_moves(c: Any) -> float:
    """A sandbox on n2 paused (its pause published), n2 killed: until ``connect`` through the gateway
    answers from another node (Ray notices the death, the controller fences n2, a live node adopts)."""
    import redis
    from e2b import Sandbox

    from aenv.directory import keys

    sbx = _on_node(c, "n2")
    sbx.pause()
    r = redis.Redis.from_url(c.redis.url, decode_responses=True)
    try:
        deadline = time.monotonic() + 120
        while not r.hget(keys.sandbox_key(sbx.sandbox_id), "paused"):
            if time.monotonic() > deadline:
                raise RuntimeError("the pause was never published")
            time.sleep(0.05)
    finally:
        r.close()
    t0 = time.perf_counter()
    c.kill_node(1)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            back = Sandbox.connect(sbx.sandbox_id, api_url=c.url, sandbox_url=c.url)
        except Exception:  # noqa: BLE001 - 404 node_down until the controller fences the node
            time.sleep(0.05)
            continue
        took = ms_since(t0)
        back.kill()
        return took
    raise RuntimeError("the published pause never resumed on another node")


def _missing() -> str | None:
    import shutil

    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if importlib.util.find_spec("ray") is None:
        return "Ray is not installed"
    if shutil.which("redis-server") is None:
        return "redis-server is not installed"
    return None

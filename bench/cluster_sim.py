"""``cluster-sim``: the real gateway(s) and the real Redis directory in front of 10, 100 and 1,000 simulated
nodes (``aenv.testing.simnode``: one asyncio process, a listener per node, the real registration and
bindings), so that the gateway's scaling is measured without 1,000 machines.

For each node count: creates/s through 1 and 3 gateway replicas (a closed-loop pool of clients, round
robin over the replicas), routed-call latency (``GET /sandboxes/{id}`` of random sandboxes), placement
quality (coefficient of variation of creates per node; the share landing on a node warm for the
template, against the share of warm nodes, which random placement would get), the gateways' CPU while
idle (probes and directory polls alone) and under load, creates/s while nodes die, come back and join,
and the time from a node's death to every gateway noticing (down), fencing it (dead: the simulated
controller's ``mark_dead``), and back up after its new incarnation. At the largest count, Redis
``used_memory`` and the gateways' RSS as live sandboxes grow to 100,000 (made in place by the nodes,
bound with the real script: the gateways learn them from the event stream), with routed calls to them.

Not in ``all``: ``python -m bench --scenarios cluster-sim`` (``--smoke``: 10 nodes, short phases). No aenv
server is started for it. The chart (``cluster-sim.png``) is written beside the results.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from aenv.cluster.procs import stop_process
from aenv.cluster.redis_proc import RedisProc, start_redis
from aenv.testing.server import API_KEY
from bench.context import Ctx
from bench.rows import Row, row, scenario, value_row

KEY = {"X-API-KEY": API_KEY}
TEMPLATES = 20
WARM_PER_NODE = 3


@dataclass
class Plan:
    counts: tuple[int, ...]
    phase_s: float  # each measured phase
    clients: int  # closed-loop clients
    fills: tuple[int, ...]  # live sandbox counts for the memory curve
    kills: int  # node deaths timed per count


def plan(smoke: bool) -> Plan:
    if smoke:
        return Plan((10,), 2.0, 8, (100, 1000), 1)
    return Plan((10, 100, 1000), 6.0, 32, (1000, 10_000, 30_000, 100_000), 3)


# ---- processes ---------------------------------------------------------------------------------------
def free_range(count: int) -> int:
    """A base port with ``count`` free ports after it (each tried)."""
    rng = random.Random()
    for _ in range(50):
        base = rng.randrange(20000, 60000 - count)
        socks = []
        try:
            for p in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SimCluster:
    """Redis, one simnode process with ``n`` nodes, and the gateways in front (started by ``gateways``)."""

    def __init__(self, tmp: Path, n: int, extra_ports: int = 64, sim_args: tuple[str, ...] = ()) -> None:
        self.tmp = tmp
        self.n = n
        self.sim_args = sim_args  # more simnode flags (e.g. --capacity)
        self.redis: RedisProc | None = None
        self.sim: subprocess.Popen[bytes] | None = None
        self.gws: list[tuple[subprocess.Popen[bytes], str]] = []
        self.base = free_range(n + extra_ports)
        self.admin_port = _free_port()
        self.admin = f"http://127.0.0.1:{self.admin_port}"

    def start(self) -> None:
        self.redis = start_redis(self.tmp / "redis")
        argv = [sys.executable, "-m", "aenv.testing.simnode", "--nodes", str(self.n), "--base-port", str(self.base),
                "--admin-port", str(self.admin_port), "--redis", self.redis.url, "--templates", str(TEMPLATES),
                "--warm-per-node", str(WARM_PER_NODE), "--log-level", "info", *self.sim_args]  # fmt: skip
        with (self.tmp / "sim.log").open("ab") as log:
            self.sim = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait(lambda: self.stats()["alive"] == self.n, 300, "simnode", self.tmp / "sim.log")

    def stats(self) -> dict[str, Any]:
        return dict(httpx.get(self.admin + "/stats", timeout=30, trust_env=False).json())

    def admin_call(self, what: str, **q: Any) -> dict[str, Any]:
        return dict(httpx.post(self.admin + "/" + what, params=q, timeout=600, trust_env=False).json())

    def gateways(self, count: int) -> list[str]:
        """``count`` gateways on the directory (``--redis``), each with every node up."""
        assert self.redis is not None
        for i in range(count):
            port = _free_port()
            env = {**os.environ, "AENV_API_KEYS": API_KEY, "AENV_STATE_DIR": str(self.tmp / f"gw{i}")}
            argv = [sys.executable, "-m", "aenv.cli.main", "gateway", "--redis", self.redis.url, "--port", str(port),
                    "--log-level", "warning"]  # fmt: skip
            with (self.tmp / f"gw{i}.log").open("ab") as log:
                proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            self.gws.append((proc, f"http://127.0.0.1:{port}"))
        for i, (_, url) in enumerate(self.gws):
            self._wait(lambda u=url: _health(u).get("nodesUp") == self.alive(), 300, "gateway", self.tmp / f"gw{i}.log")
        return [u for _, u in self.gws]

    def alive(self) -> int:
        return int(self.stats()["alive"])

    def stop_gateways(self) -> None:
        for proc, _ in self.gws:
            stop_process(proc)
        self.gws = []

    def gateway_pids(self) -> list[int]:
        return [p.pid for p, _ in self.gws]

    def close(self) -> None:
        self.stop_gateways()
        if self.sim is not None:
            stop_process(self.sim)
        if self.redis is not None:
            self.redis.stop()

    def _wait(self, cond: Any, timeout: float, what: str, log: Path) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                if cond():
                    return
            time.sleep(0.2)
        tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
        raise RuntimeError(f"{what} not ready in {timeout:.0f} s:\n{tail}")


def _health(url: str) -> dict[str, Any]:
    return dict(httpx.get(url + "/health", timeout=10, trust_env=False).json())


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@contextlib.contextmanager
def cpu_meter(pids: list[int], out: dict[str, float]) -> Iterator[None]:
    """``out["cpu"]``: the mean CPU share (1.0 = one core) of ``pids`` over the block, per process."""
    t0, c0 = time.perf_counter(), sum(cpu_s(p) for p in pids)
    yield
    out["cpu"] = (sum(cpu_s(p) for p in pids) - c0) / (time.perf_counter() - t0) / max(1, len(pids))


# ---- load ----------------------------------------------------------------------------------------
@dataclass
class Load:
    latencies: list[float]
    ok: int
    failed: dict[int, int]
    seconds: float
    ids: list[str]

    @property
    def rate(self) -> float:
        return self.ok / self.seconds if self.seconds else 0.0


async def _closed_loop(gws: list[str], clients: int, seconds: float, make: Any) -> Load:
    """``clients`` loops, each sending ``make(i) -> (method, path, json)`` to the gateways in turn until
    ``seconds`` passed; records latencies of 2xx answers."""
    lat: list[float] = []
    failed: dict[int, int] = {}
    ids: list[str] = []
    limits = httpx.Limits(max_connections=clients * 2, max_keepalive_connections=clients * 2)
    async with httpx.AsyncClient(headers=KEY, timeout=60, limits=limits, trust_env=False) as client:
        t0 = time.perf_counter()
        deadline = t0 + seconds

        async def loop(w: int) -> None:
            i = w
            while time.perf_counter() < deadline:
                method, path, body = make(i)
                t = time.perf_counter()
                try:
                    r = await client.request(method, gws[i % len(gws)] + path, json=body)
                    status = r.status_code
                except httpx.HTTPError:
                    status = 0
                if 200 <= status < 300:
                    lat.append((time.perf_counter() - t) * 1000)
                    if method == "POST":
                        ids.append(r.json()["sandboxID"])
                else:
                    failed[status] = failed.get(status, 0) + 1
                i += clients

        await asyncio.gather(*(loop(w) for w in range(clients)))
        took = time.perf_counter() - t0
    return Load(lat, len(lat), failed, took, ids)


def creates(gws: list[str], clients: int, seconds: float, seed: int) -> Load:
    rng = random.Random(seed)

    def make(_: int) -> tuple[str, str, Any]:
        return "POST", "/sandboxes", {"templateID": f"t{rng.randrange(TEMPLATES)}", "timeout": 3600}

    return asyncio.run(_closed_loop(gws, clients, seconds, make))


def routed(gws: list[str], clients: int, seconds: float, ids: list[str], seed: int) -> Load:
    rng = random.Random(seed)

    def make(_: int) -> tuple[str, str, Any]:
        return "GET", f"/sandboxes/{rng.choice(ids)}", None

    return asyncio.run(_closed_loop(gws, clients, seconds, make))


# ---- placement -----------------------------------------------------------------------------------
def cv(values: list[float]) -> float:
    """Coefficient of variation (population stdev / mean); 0 for fewer than 2 values or a zero mean."""
    if len(values) < 2 or not statistics.fmean(values):
        return 0.0
    return statistics.pstdev(values) / statistics.fmean(values)


def random_cv(total: int, nodes: int) -> float:
    """The CV of creates per node that placing ``total`` creates uniformly at random on ``nodes`` would give
    (multinomial: sqrt((1 - 1/n) · n / total))."""
    return ((1 - 1 / nodes) * nodes / total) ** 0.5 if total and nodes > 1 else 0.0


def placement_delta(before: dict[str, Any], after: dict[str, Any]) -> tuple[float, float, int]:
    """(CV of creates per live node, share of creates on a node warm for the template, creates) between
    two ``/stats``."""
    was = {n["id"]: n for n in before["nodes"]}
    made, warm = [], 0
    for n in after["nodes"]:
        if not n["alive"]:
            continue
        old = was.get(n["id"], {"creates": 0, "warmSetHits": 0})
        made.append(n["creates"] - old["creates"])
        warm += n["warmSetHits"] - old["warmSetHits"]
    total = sum(made)
    return cv([float(m) for m in made]), (warm / total if total else 0.0), total


# ---- node death ----------------------------------------------------------------------------------
def _states(gws: list[str], node: str) -> list[str]:
    out = []
    for g in gws:
        try:
            out.append(str(httpx.get(f"{g}/nodes/{node}", headers=KEY, timeout=5, trust_env=False).json()["state"]))
        except (httpx.HTTPError, ValueError, KeyError):
            out.append("?")
    return out


def death(c: SimCluster, gws: list[str], rng: random.Random) -> tuple[float, float, float]:
    """A node with sandboxes killed: ms until every gateway says it is down, until every one says dead
    (fenced), and, revived, until every one says up again."""
    nodes = [n for n in c.stats()["nodes"] if n["alive"] and n["sandboxes"]] or \
        [n for n in c.stats()["nodes"] if n["alive"]]  # fmt: skip
    node = rng.choice(nodes)["id"]
    t0 = time.perf_counter()
    c.admin_call("kill", node=node)
    down = dead = None
    deadline = t0 + 60
    while time.perf_counter() < deadline and dead is None:
        states = _states(gws, node)
        now = (time.perf_counter() - t0) * 1000
        if down is None and all(s in ("down", "dead") for s in states):
            down = now
        if all(s == "dead" for s in states):
            dead = now
        time.sleep(0.02)
    t1 = time.perf_counter()
    c.admin_call("revive", node=node)
    up = None
    while time.perf_counter() < t1 + 60 and up is None:
        if all(s == "up" for s in _states(gws, node)):
            up = (time.perf_counter() - t1) * 1000
        time.sleep(0.02)
    if down is None or dead is None or up is None:
        raise RuntimeError(f"node {node}: down={down} dead={dead} up={up} (gateways never agreed)")
    return down, dead, up


async def _churn(c: SimCluster, seconds: float, rng: random.Random, log: list[str]) -> None:
    """Every second one live node dies; it comes back 2 s later; every 3 s a new node joins."""
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    dead: list[tuple[float, str]] = []
    tick = 0
    while time.perf_counter() - t0 < seconds:
        stats = await loop.run_in_executor(None, c.stats)
        alive = [n["id"] for n in stats["nodes"] if n["alive"]]
        if len(alive) > 2:
            victim = rng.choice(alive)
            await loop.run_in_executor(None, functools.partial(c.admin_call, "kill", node=victim))
            dead.append((time.perf_counter(), victim))
            log.append(f"kill {victim}")
        for at, node in [d for d in dead if time.perf_counter() - d[0] >= 2.0]:
            await loop.run_in_executor(None, functools.partial(c.admin_call, "revive", node=node))
            dead.remove((at, node))
            log.append(f"revive {node}")
        if tick % 3 == 2:
            got = await loop.run_in_executor(None, functools.partial(c.admin_call, "join", count=1))
            log.append(f"join {got['joined']}")
        tick += 1
        await asyncio.sleep(1.0)
    for _, node in dead:
        await loop.run_in_executor(None, functools.partial(c.admin_call, "revive", node=node))


def creates_with_churn(c: SimCluster, gws: list[str], clients: int, seconds: float, seed: int) -> tuple[Load, list[str]]:
    rng = random.Random(seed)
    log: list[str] = []

    def make(_: int) -> tuple[str, str, Any]:
        return "POST", "/sandboxes", {"templateID": f"t{rng.randrange(TEMPLATES)}", "timeout": 3600}

    async def both() -> Load:
        churn = asyncio.create_task(_churn(c, seconds, random.Random(seed + 1), log))
        got = await _closed_loop(gws, clients, seconds, make)
        await churn
        return got

    return asyncio.run(both()), log


# ---- the scenario --------------------------------------------------------------------------------
def _fmt_failed(failed: dict[int, int]) -> str:
    return ", ".join(f"{k or 'conn'}×{v}" for k, v in sorted(failed.items())) or "none"


def cluster_sim(ctx: Ctx) -> dict[str, Any]:
    """Real gateways (1 and 3) and Redis in front of 10/100/1,000 simulated nodes: creates/s, routed p50/p99,
    placement quality, death → fenced, directory memory to 100,000 sandboxes."""
    p = plan(ctx.smoke)
    rows: list[Row] = []
    notes: list[str] = []
    series: dict[str, Any] = {"creates": {}, "p50": {}, "p99": {}, "memory": [], "idle_cpu": {}, "load_cpu": {}}
    rng = random.Random(39)
    for n in p.counts:
        with tempfile.TemporaryDirectory(prefix="aenv-sim-") as tmp:
            c = SimCluster(Path(tmp), n)
            try:
                t0 = time.perf_counter()
                c.start()
                rows.append(value_row(f"{n} nodes: simnode start → all registered", "sim", (time.perf_counter() - t0) * 1000,
                                      1, "ms"))  # fmt: skip
                for reps in (1, 3):
                    system = f"sim, {reps} gateway" + ("s" if reps > 1 else "")
                    t0 = time.perf_counter()
                    gws = c.gateways(reps)
                    rows.append(value_row(f"{n} nodes: gateways start → every node up", system,
                                          (time.perf_counter() - t0) * 1000, reps, "ms"))  # fmt: skip
                    idle: dict[str, float] = {}
                    with cpu_meter(c.gateway_pids(), idle):
                        time.sleep(p.phase_s / 2)
                    rows.append(value_row(f"{n} nodes: gateway CPU while idle (probes, directory polls)", system,
                                          idle["cpu"] * 100, 1, "% of a core"))  # fmt: skip
                    before = c.stats()
                    busy: dict[str, float] = {}
                    sim_cpu: dict[str, float] = {}
                    me: dict[str, float] = {}
                    assert c.sim is not None
                    with cpu_meter(c.gateway_pids(), busy), cpu_meter([c.sim.pid], sim_cpu), cpu_meter([os.getpid()], me):
                        load = creates(gws, p.clients, p.phase_s, seed=n * 10 + reps)
                    after = c.stats()
                    spread, warm, made = placement_delta(before, after)
                    rows.append(value_row(f"{n} nodes: creates/s ({p.clients} clients)", system, load.rate, load.ok, "/s",
                                          f"failed: {_fmt_failed(load.failed)}; CPU (% of a core): each gateway "
                                          f"{busy['cpu'] * 100:.0f}, simnode {sim_cpu['cpu'] * 100:.0f}, "
                                          f"clients {me['cpu'] * 100:.0f}"))
                    rows.append(row(f"{n} nodes: create through the gateway", system, load.latencies))
                    rows.append(value_row(f"{n} nodes: creates per node, coefficient of variation", system,
                                          spread * 100, made, "% CV",
                                          f"0 = every node got as many; random placement: {random_cv(made, n) * 100:.0f}%"))
                    rows.append(value_row(f"{n} nodes: creates on a node warm for the template", system, warm * 100, made,
                                          "%", f"random placement: {100 * WARM_PER_NODE / TEMPLATES:.0f}%"))
                    series["creates"].setdefault(reps, []).append((n, load.rate))
                    series["idle_cpu"].setdefault(reps, []).append((n, idle["cpu"] * 100))
                    series["load_cpu"].setdefault(reps, []).append((n, busy["cpu"] * 100))
                    got = routed(gws, p.clients, p.phase_s, load.ids, seed=n) if load.ids else Load([], 0, {}, 0, [])
                    rows.append(row(f"{n} nodes: routed GET /sandboxes/{{id}}", system, got.latencies,
                                    note=f"{got.rate:.0f}/s; failed: {_fmt_failed(got.failed)}"))
                    if got.latencies:
                        series["p50"].setdefault(reps, []).append((n, statistics.median(got.latencies)))
                        series["p99"].setdefault(reps, []).append((n, _p99(got.latencies)))
                    if reps == 3:
                        _deaths(c, gws, p, n, system, rng, rows)
                        churn, log = creates_with_churn(c, gws, p.clients, p.phase_s * 1.5, seed=n)
                        rows.append(value_row(f"{n} nodes: creates/s while nodes die, come back and join", system,
                                              churn.rate, churn.ok, "/s",
                                              f"failed: {_fmt_failed(churn.failed)}; {len(log)} churn events"))
                        if n == p.counts[-1]:
                            _memory(c, p, n, system, rows, series, notes)
                    c.admin_call("clear")
                    c.stop_gateways()
            finally:
                c.close()
    notes.append("one machine: Redis, the simnode process (every node), each gateway and the clients share its CPUs; "
                 "the sim answers a create in 15-40 ms (2-5 ms from a warm pool), other calls in 0.2-1 ms")
    notes.append(f"{TEMPLATES} templates; each node keeps {WARM_PER_NODE} warm (2 each, refilled 0.5 s after a hand-out); "
                 "node capacity 100-400 sandboxes; gateways probe every node every 1 s (the default)")
    notes.append("node death: the simulated controller (Ray's health check: 3 × 0.5 s) calls the directory's mark_dead; "
                 "'down' = every gateway stopped placing there, 'dead' = every gateway fenced it")
    out = scenario("cluster simulation: real gateways and Redis directory, simulated nodes", rows, notes)
    out["sim_series"] = series
    return out


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def _deaths(c: SimCluster, gws: list[str], p: Plan, n: int, system: str, rng: random.Random, rows: list[Row]) -> None:
    downs, deads, ups = [], [], []
    for _ in range(p.kills):
        down, dead, up = death(c, gws, rng)
        downs.append(down)
        deads.append(dead)
        ups.append(up)
    rows.append(row(f"{n} nodes: node killed → every gateway stops placing there", system, downs))
    rows.append(row(f"{n} nodes: node killed → fenced (dead) on every gateway", system, deads))
    rows.append(row(f"{n} nodes: node back (new incarnation) → up on every gateway", system, ups))


def _memory(c: SimCluster, p: Plan, n: int, system: str, rows: list[Row], series: dict[str, Any],
            notes: list[str]) -> None:  # fmt: skip
    """Redis used_memory and gateway RSS as live sandboxes grow (made in place), routed calls at the top."""
    import redis

    assert c.redis is not None
    r = redis.Redis.from_url(c.redis.url)
    try:
        c.admin_call("clear")
        time.sleep(1.0)
        base = int(r.info("memory")["used_memory"])
        series["memory"].append((0, base / 2**20))
        have = 0
        for target in p.fills:
            t0 = time.perf_counter()
            c.admin_call("fill", count=target - have)
            took = time.perf_counter() - t0
            have = target
            used = int(r.info("memory")["used_memory"])
            series["memory"].append((target, used / 2**20))
            rows.append(value_row(f"Redis used_memory at {target:,} live sandboxes ({n} nodes)", "sim directory",
                                  used / 2**20, target, "MiB",
                                  f"{(used - base) / target:.0f} B per sandbox; bound at {target / took:.0f}/s"))
        time.sleep(2.0)  # the gateways take in the bind events
        rows.append(value_row(f"gateway RSS at {have:,} live sandboxes", system,
                              statistics.fmean(rss_mb(pid) for pid in c.gateway_pids()), len(c.gateway_pids()), "MB"))
        gws = [u for _, u in c.gws]
        ids = _sample_ids(r, 2000)
        got = routed(gws, p.clients, p.phase_s, ids, seed=7)
        rows.append(row(f"routed GET at {have:,} live sandboxes ({n} nodes)", system, got.latencies,
                        note=f"{got.rate:.0f}/s; failed: {_fmt_failed(got.failed)}"))
    finally:
        r.close()
    notes.append(f"directory memory: sandboxes made in place by the simulated nodes (the real BIND script, pipelined); "
                 f"Redis empty of sandboxes used {base / 2**20:.1f} MiB")


def _sample_ids(r: Any, k: int) -> list[str]:
    """Up to ``k`` bound sandbox ids, from the directory."""
    out: list[str] = []
    for key in r.scan_iter(match="aenv:sbx:*", count=1000):
        if r.hget(key, "state") != b"live":
            continue  # lost with a node killed earlier: the gateway answers 404 naming it
        out.append(key.decode().removeprefix("aenv:sbx:"))
        if len(out) >= k:
            break
    return out


# ---- chart ---------------------------------------------------------------------------------------
def render_chart(series: dict[str, Any], path: Path, title: str) -> bool:
    """creates/s and routed p50/p99 against node count (1 and 3 gateways), Redis memory against live
    sandboxes. False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    for reps, pts in sorted(series["creates"].items(), key=lambda kv: int(kv[0])):
        xs, ys = zip(*pts, strict=True)
        axes[0].plot(xs, ys, marker="o", label=f"{reps} gateway(s)")
    axes[0].set(xscale="log", xlabel="simulated nodes", ylabel="creates/s", title="creates/s through the gateways")
    for reps, pts in sorted(series["p99"].items(), key=lambda kv: int(kv[0])):
        xs, ys = zip(*pts, strict=True)
        axes[1].plot(xs, ys, marker="o", label=f"p99, {reps} gateway(s)")
    for reps, pts in sorted(series["p50"].items(), key=lambda kv: int(kv[0])):
        xs, ys = zip(*pts, strict=True)
        axes[1].plot(xs, ys, marker=".", linestyle="--", label=f"p50, {reps} gateway(s)")
    axes[1].set(xscale="log", yscale="log", xlabel="simulated nodes", ylabel="ms", title="routed GET /sandboxes/{id}")
    if series["memory"]:
        xs, ys = zip(*series["memory"], strict=True)
        axes[2].plot(xs, ys, marker="o", color="tab:red")
    axes[2].set(xlabel="live sandboxes", ylabel="MiB", title="Redis used_memory (directory)")
    for key, style in (("idle_cpu", "-"), ("load_cpu", "--")):
        for reps, pts in sorted(series.get(key, {}).items(), key=lambda kv: int(kv[0])):
            xs, ys = zip(*pts, strict=True)
            what = "idle" if key == "idle_cpu" else "during creates"
            axes[3].plot(xs, ys, marker="o", linestyle=style, label=f"{what}, {reps} gateway(s)")
    axes[3].set(xscale="log", xlabel="simulated nodes", ylabel="% of a core", title="CPU of each gateway")
    for ax in (axes[0], axes[1], axes[3]):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    axes[2].grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


if __name__ == "__main__":  # the chart again from a results.json: python -m bench.cluster_sim RESULTS.json OUT.png
    import json

    data = json.loads(Path(sys.argv[1]).read_text())
    sc = next(run["scenarios"]["cluster-sim"] for run in data["runs"].values() if "cluster-sim" in run["scenarios"])
    meta = data["meta"]
    render_chart(sc["sim_series"], Path(sys.argv[2]),
                 f"aenv cluster simulation, {meta['date'][:10]}, {meta['mode']} run (2 shared vCPUs, load {meta['load_before'][0]})")

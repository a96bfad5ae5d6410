"""Fair shares between teams: one team's burst of creates against another team's creates, on a server of
its own with two teams (``AENV_TEAMS``), in the same run.

* ``team B create, alone``: team B creates (and kills) sandboxes one after another on an idle server: its
  normal latency, the baseline.
* ``team B create, during team A's burst``: the same, for as long as team A's burst of 200 creates (40
  in ``--smoke``) is in flight. Admission is round robin between teams before runs (``core/admission.py``),
  so B's create waits for one start slot, not behind A's queue; what is left is the CPU the burst takes.
* ``team A burst, create``: each of A's creates, from the burst's start to its answer (the queue included).

Passes, each on a server of its own: as configured; with ``team_burst_yield`` off (the burst's restores
keep their CPU weight while B's create is in flight); and (full runs) without the per-team cap.

The create is E2B's ``POST /v2/sandboxes`` (what the SDK sends), measured to its answer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.context import Ctx
from bench.rows import ms_since, row, scenario

KEY_A, KEY_B = "bench-team-a-" + "a" * 16, "bench-team-b-" + "b" * 16
TEAMS = {"a": {"keys": [KEY_A]}, "b": {"keys": [KEY_B]}}
ADMIN = "bench-admin-" + "c" * 16


def _create(client: httpx.Client, key: str) -> tuple[float, str | None]:
    t0 = time.perf_counter()
    r = client.post("/v2/sandboxes", json={"templateID": "base", "timeout": 600}, headers={"X-API-KEY": key})
    ms = ms_since(t0)
    return ms, (r.json()["sandboxID"] if r.status_code == 201 else None)


def _b_creates(client: httpx.Client, n: int, stop: threading.Event | None = None) -> list[float]:
    """Team B's creates, one after another, each killed before the next (its count stays 1)."""
    out: list[float] = []
    for _ in range(n):
        if stop is not None and stop.is_set():
            break
        ms, sid = _create(client, KEY_B)
        if sid is not None:
            out.append(ms)
            client.delete(f"/sandboxes/{sid}", headers={"X-API-KEY": KEY_B})
        time.sleep(0.2)
    return out


@dataclass
class Pass:
    alone: list[float]
    during: list[float]
    burst: list[float]
    refused: int
    burst_s: float


def _a_burst(url: str, burst: int) -> None:
    """Team A's burst, in a process of its own (``_burst``): prints ``started``, then each create's
    ``[ms, sandbox ID or null]`` as one JSON line."""
    # one client for all threads: a client each cost this process ~20 ms of CPU (its TLS context),
    # taken from the server on 2 cores
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    with (httpx.Client(base_url=url, trust_env=False, timeout=120, limits=limits) as c,
          ThreadPoolExecutor(min(burst, 64)) as pool):
        print("started", flush=True)  # the process is up (about a second): the burst begins now
        print(json.dumps(list(pool.map(lambda _: _create(c, KEY_A), range(burst)))), flush=True)


def _burst(url: str, client: httpx.Client, burst: int) -> Pass:
    """Team B's creates for as long as team A's burst of ``burst`` creates is in flight. The burst's 64
    client threads run in another process: in this one, B's timing thread waited its turn for the GIL
    behind them (measured: several ms of B's p50 of ~12 ms was the bench's own Python, not the server)."""
    code = f"from bench.teams import _a_burst; _a_burst({url!r}, {burst})"
    root = str(Path(__file__).resolve().parents[1])
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=root,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.stdout is not None
    proc.stdout.readline()  # "started"
    t0 = time.perf_counter()
    got: list[tuple[float, str | None]] = []
    over = threading.Event()

    def burst_over() -> None:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        got.extend((ms, sid) for ms, sid in (json.loads(line) if line else []))
        over.set()

    waiter = threading.Thread(target=burst_over, daemon=True)
    waiter.start()
    time.sleep(0.3)  # the burst is queued
    during = _b_creates(client, 10**6, over)  # as many as fit while the burst lasts
    waiter.join()
    proc.wait()
    burst_s = time.perf_counter() - t0
    a_ms = [ms for ms, sid in got if sid is not None]
    for _, sid in got:
        if sid is not None:
            client.delete(f"/sandboxes/{sid}", headers={"X-API-KEY": KEY_A})
    return Pass([], during, a_ms, sum(1 for _, sid in got if sid is None), burst_s)


def _pass(ctx: Ctx, burst: int, extra: dict[str, str]) -> Pass:
    """One server of two teams (``extra``: more of its settings): B alone, then B during A's burst."""
    from aenv.testing.server import start_server, stop_server

    env = {"AENV_TEAMS": json.dumps(TEAMS), "AENV_ADMIN_KEYS": ADMIN, "AENV_POOL_SIZE": "2",
           "AENV_MAX_SANDBOXES": str(burst + 50), **extra}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="aenv-bench-teams-") as tmp:
        srv = start_server(Path(tmp), ctx.runtime, env)
        try:
            with httpx.Client(base_url=srv.url, trust_env=False, timeout=120) as client:
                # warm-up: each team's first start (with a uid range per team, its range's pool and
                # process image are made on first use), then the pools refill
                _b_creates(client, 2)
                for _ in range(2):
                    _, sid = _create(client, KEY_A)
                    if sid is not None:
                        client.delete(f"/sandboxes/{sid}", headers={"X-API-KEY": KEY_A})
                time.sleep(3)
                alone = _b_creates(client, ctx.n(4, 12))
                got = _burst(srv.url, client, burst)
                got.alone = alone
                return got
        finally:
            stop_server(srv)


def teams(ctx: Ctx) -> dict[str, Any]:
    burst = 40 if ctx.smoke else 200
    system = f"aenv-{ctx.runtime}"
    passes = [(system, _pass(ctx, burst, {})),
              # the same without the burst giving way (core/admission.py ``contended``): what that buys
              (f"burst not yielding ({system})", _pass(ctx, burst, {"AENV_TEAM_BURST_YIELD": "false"}))]
    if not ctx.smoke:  # the same, one team allowed every start slot: what the per-team cap buys
        passes.append((f"no per-team cap ({system})", _pass(ctx, burst, {"AENV_TEAM_CONCURRENT_STARTS": "31"})))
    rows, notes = [], []
    for name, got in passes:
        rows += [
            row("team B create, alone", name, got.alone),
            row(f"team B create, during team A's burst of {burst}", name, got.during),
            row(f"team A burst of {burst}, create (queue included)", name, got.burst),
        ]
        notes.append(f"{name}: team A's burst: {len(got.burst)} created, {got.refused} refused, all answered in "
                     f"{got.burst_s:.1f} s")
    notes.append("team B creates one at a time (alone: a fixed count; during the burst: as many as fit), each "
                 "killed before the next")
    return scenario("fair shares between teams", rows, notes)

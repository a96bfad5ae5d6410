"""Fair shares between teams: one team's burst of creates against another team's creates, on a server of
its own with two teams (``AENV_TEAMS``), in the same run.

* ``team B create, alone``: team B creates (and kills) sandboxes one after another on an idle server: its
  normal latency, the baseline.
* ``team B create, during team A's burst``: the same, while team A's burst of 200 creates (40 in
  ``--smoke``) is in flight. Admission is round robin between teams before runs (``core/admission.py``),
  so B's create waits for one start slot, not behind A's queue; what is left is the CPU the burst takes.
* ``team A burst, create``: each of A's creates, from the burst's start to its answer (the queue included).

The create is E2B's ``POST /v2/sandboxes`` (what the SDK sends), measured to its answer.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
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


def teams(ctx: Ctx) -> dict[str, Any]:
    from aenv.testing.server import start_server, stop_server

    burst = 40 if ctx.smoke else 200
    n_b = ctx.n(4, 12)
    system = f"aenv-{ctx.runtime}"
    env = {"AENV_TEAMS": json.dumps(TEAMS), "AENV_ADMIN_KEYS": ADMIN, "AENV_POOL_SIZE": "2",
           "AENV_MAX_SANDBOXES": str(burst + 50)}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="aenv-bench-teams-") as tmp:
        srv = start_server(Path(tmp), ctx.runtime, env)
        try:
            with httpx.Client(base_url=srv.url, trust_env=False, timeout=120) as client:
                _b_creates(client, 2)  # warm-up: the template's first start
                time.sleep(2)  # the pool refills
                alone = _b_creates(client, n_b)
                a_ms: list[float] = []
                a_ids: list[str] = []
                refused = 0
                lock = threading.Lock()

                def one_of_a(_: int) -> None:
                    nonlocal refused
                    with httpx.Client(base_url=srv.url, trust_env=False, timeout=120) as c:
                        ms, sid = _create(c, KEY_A)
                    with lock:
                        if sid is None:
                            refused += 1
                        else:
                            a_ms.append(ms)
                            a_ids.append(sid)

                t0 = time.perf_counter()
                with ThreadPoolExecutor(min(burst, 64)) as pool:
                    futures = [pool.submit(one_of_a, i) for i in range(burst)]
                    time.sleep(0.3)  # the burst is queued
                    during = _b_creates(client, n_b)
                    for f in futures:
                        f.result()
                burst_s = (time.perf_counter() - t0)
                for sid in a_ids:
                    client.delete(f"/sandboxes/{sid}", headers={"X-API-KEY": KEY_A})
        finally:
            stop_server(srv)
    rows = [
        row("team B create, alone", system, alone),
        row(f"team B create, during team A's burst of {burst}", system, during),
        row(f"team A burst of {burst}, create (queue included)", system, a_ms),
    ]
    notes = [f"team A's burst: {len(a_ms)} created, {refused} refused, all answered in {burst_s:.1f} s; "
             f"team B created one at a time, {n_b} per row, each killed before the next"]
    return scenario("fair shares between teams", rows, notes)

"""``console-sim``: issue 38's console row through the real gateway in front of simulated nodes, where
creates are answered at 100/s (``console`` on one real node reached 1.8/s on this 2-core host: real starts
are CPU-bound here).

Redis, one simnode process with ``N`` nodes (``aenv.testing.simnode``: the console's reads too: the paged
list, the summary, the metrics and ``/aenv/events``) and one real ``aenv gateway`` (API keys on, so the
page's log-in is the real one), as ``cluster-sim`` starts them. Then, in one run:

* fill: ``count`` sandboxes (2,000; smoke 20) through the unmodified e2b SDK via the gateway, a few threads
  at a time;
* the JSON routes the page reads through the gateway (first page, summary, metrics of 50 rows, page 2,
  the walk of every page) alternating with first-paint samples in Chromium: through the log-in form, and
  a logged-in reload (the session cookie set): ``console``'s own measurements (``bench/console.py``);
* live: the page open while SDK creates arrive at ``rate``/s (100) for ``live_s`` (10 s; smoke 2): each
  create's 201 → its row in the page, the events on a separate stream, the rate actually answered;
* paging at scale: the nodes make sandboxes in place (``/fill``) up to 10,000 (smoke 1,000) live, then the
  first page and the summary again, and a few logged-in first paints;
* clean-up: ``DELETE /aenv/sandboxes?metadata=run=<run>`` through the gateway.

Not in ``all``: ``python -m bench --scenarios console-sim [--smoke]``; no aenv server, no baselines. Knobs:
``console``'s AENV_BENCH_CONSOLE_COUNT, _RATE, _LIVE_S, _SAMPLES, and AENV_BENCH_CONSOLE_NODES (simulated
nodes; 10, smoke 3), AENV_BENCH_CONSOLE_BIG (live sandboxes of the paging check; 10000, smoke 1000).
"""

from __future__ import annotations

import concurrent.futures
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench import console as base
from bench.console_probe import Events
from bench.context import Ctx
from bench.rows import Row, ms_since, row, scenario, value_row

TITLE = "console-sim: the sandbox list through the real gateway over simulated nodes, 2,000 rows, 100 creates/s"
CONSOLE = "gateway + sim console"
JSON_SYS = "JSON GET /v2/sandboxes?limit=50"
FILL_THREADS = 8


def _env_int(name: str, full: int, small: int, smoke: bool) -> int:
    raw = os.environ.get(f"AENV_BENCH_CONSOLE_{name}", "").strip()
    return int(raw) if raw else (small if smoke else full)


def _fill(url: str, count: int, run: str, made: list[str]) -> tuple[list[Row], list[str]]:
    """``count`` sandboxes through the SDK, ``FILL_THREADS`` at a time: the fill's rows, and notes."""
    from e2b import Sandbox

    kw = base._sdk(url)
    failures: list[str] = []

    def one(_: int) -> float | None:
        t0 = time.perf_counter()
        try:
            sbx = Sandbox.create("base", metadata={"run": run}, timeout=3600, **kw)
        except Exception as exc:  # noqa: BLE001 - counted and reported
            failures.append(f"{type(exc).__name__}: {str(exc)[:160]}")
            return None
        made.append(sbx.sandbox_id)
        return ms_since(t0)

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(FILL_THREADS) as pool:
        lat = [x for x in pool.map(one, range(count)) if x is not None]
    took = time.perf_counter() - t0
    sdk = f"`Sandbox.create(\"base\", metadata={{run}})` via the gateway, {FILL_THREADS} at a time"
    return [value_row("console fill: live sandboxes", "gateway + sim", len(made), len(made), "count",
                      note=f"{len(made) / max(took, 1e-9):.0f}/s over {took:.1f} s; {len(failures)} failed"),
            row("console fill: create (SDK)", "gateway + sim", lat, note=sdk)], \
        [f"fill creates that failed: {len(failures)}, first: {failures[0]}"] if failures else []


def _big(c: Any, client: Any, browser: Any, url: str, key: str, have: int, big: int, run: str, samples: int
         ) -> list[Row]:  # fmt: skip
    """Live sandboxes up to ``big`` (made in place by the nodes), then the JSON first page, the summary
    and logged-in first paints at that count."""
    t0 = time.perf_counter()
    made = int(c.admin_call("fill", count=max(0, big - have), metadata=f"run={run}")["made"])
    fill_s = time.perf_counter() - t0
    total = int(client.get("/aenv/sandboxes/summary").json()["total"])
    firsts, sums, pages2 = [], [], []
    for _ in range(20):
        got = base._json_routes(client)
        firsts.append(got["first"])
        sums.append(got["summary"])
        if got["page2"] is not None:
            pages2.append(got["page2"])
    paints = [base._sample(browser, url, key, total) for _ in range(samples)]
    what = f"{total:,} live"
    return [
        row(f"console at {what}: first page of the list", JSON_SYS, firsts,
            note=f"{made} more made in place by the nodes in {fill_s:.1f} s (bound in Redis, no events); 20 calls"),
        row(f"console at {what}: summary route", "JSON GET /aenv/sandboxes/summary", sums),
        row(f"console at {what}: next page", "JSON GET /v2/sandboxes nextToken", pages2),
        row(f"console at {what}: first page of the list", f"{CONSOLE}, logged in", [p.again for p in paints],
            note="page clock: a reload with the session cookie → first row and `#total` = the server's count"),
        row(f"console at {what}: first page of the list", CONSOLE, [p.nav for p in paints],
            note="page clock: navigation start → first row and the total, through the log-in form"),
    ]


def console_sim(ctx: Ctx) -> dict[str, Any]:
    """The console at 2,000 live rows with 100 creates/s arriving, through the gateway over sim nodes."""
    import shutil

    import httpx

    from bench.cluster_sim import SimCluster, cpu_meter

    if shutil.which("redis-server") is None:
        return scenario(TITLE, [], ["redis-server is not installed (Debian's redis-server): skipped"])
    knobs = base.Knobs.from_env(ctx.smoke)
    nodes = _env_int("NODES", 10, 3, ctx.smoke)
    big = _env_int("BIG", 10_000, 1000, ctx.smoke)
    run = "console-sim-" + uuid.uuid4().hex[:8]
    key = base._sdk_key()
    capacity = (max(big, knobs.count) + knobs.live_creates) // nodes + 200
    rows: list[Row] = []
    notes = [f"issue 38's row through the gateway: {knobs.count} live rows made through the e2b SDK, live "
             f"{knobs.rate:g} creates/s for {knobs.live_s:g} s, {knobs.samples} first-paint samples; {nodes} "
             f"simulated nodes (capacity {capacity} each) behind 1 real gateway and Redis; run={run}"]
    with tempfile.TemporaryDirectory(prefix="aenv-console-sim-") as tmp:
        c = SimCluster(Path(tmp), nodes, sim_args=("--capacity", str(capacity)))
        made: list[str] = []
        try:
            c.start()
            url = c.gateways(1)[0]
            with httpx.Client(base_url=url, headers={"X-API-KEY": key}, trust_env=False, timeout=120) as client:
                fill_rows, fill_notes = _fill(url, knobs.count, run, made)
                rows += fill_rows
                notes += fill_notes
                total = int(client.get("/aenv/sandboxes/summary").json()["total"])
                notes.append(f"after the fill the summary's total was {total} (what each first paint waits for)")
                with base._browser() as browser:
                    rows += base.paint_phase(browser, client, url, key, total, knobs, CONSOLE)
                    gw_cpu: dict[str, float] = {}
                    sim_cpu: dict[str, float] = {}
                    assert c.sim is not None
                    with Events(url, key) as events:
                        with cpu_meter(c.gateway_pids(), gw_cpu), cpu_meter([c.sim.pid], sim_cpu):
                            live = base._live(browser, url, client, key, knobs, run, made)
                        time.sleep(0.5)
                    live_rows, live_notes = base._live_rows(live, events, knobs, "gateway + sim", CONSOLE)
                    rows += live_rows
                    rows.append(value_row("console live: CPU while creates arrive", "the gateway", gw_cpu["cpu"] * 100, 1,
                                          "% of a core", note=f"the simnode process (every node): {sim_cpu['cpu'] * 100:.0f}%; "
                                          "the live phase's whole span (creates, its SSE streams, the page's reloads)"))
                    notes += live_notes
                    have = int(client.get("/aenv/sandboxes/summary").json()["total"])
                    rows += _big(c, client, browser, url, key, have, big, run, max(2, knobs.samples // 2))
                t0 = time.perf_counter()
                resp = client.delete("/aenv/sandboxes", params={"metadata": f"run={run}"}, timeout=300)
                killed = len(resp.json().get("killed", [])) if resp.status_code == 200 else 0
                notes.append(f"clean-up: DELETE /aenv/sandboxes?metadata=run={run} through the gateway killed {killed} "
                             f"in {ms_since(t0) / 1000:.1f} s (HTTP {resp.status_code})")
        finally:
            c.close()
    notes.append("one machine: Redis, the simnode process (every node), the gateway, Chromium and the bench's SDK "
                 "threads share its CPUs; a sim node answers a create in 15-40 ms and a read in 0.2-1 ms "
                 "(nothing runs in its sandboxes), the list, summary, metrics and event stream as a real node shapes them")
    notes.append("the JSON calls and the browser samples alternate (one browser sample before them not kept); the "
                 "live phase follows on the same gateway, the bench's SSE stream opened before it; then the paging "
                 "check at the larger count")
    return scenario(TITLE, rows, notes)

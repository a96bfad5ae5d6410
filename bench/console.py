"""The console at scale (issue 38's acceptance row): the sandbox list with 2,000 live sandboxes, its first
paint, and its live updates while creates arrive at 100/s, beside the JSON routes it reads, in one run.

* fill: ``N`` live ``base`` sandboxes (2,000; smoke 20) made through the unmodified e2b SDK, a few threads
  at a time (scale's ramp: a memory floor stops it early, after one wait for ksmd's merge; the row says
  the count reached and why).
* the JSON routes the page reads, on the same server in the same state: ``GET /v2/sandboxes?limit=50&
  state=running,paused`` (the first page), the summary, the metrics of 50 rows, the second page through
  ``nextToken``, and a walk of every page (time to list all N).
* first paint: a fresh browser context per sample (Debian's chromium under Playwright), ``/console``,
  log in, until the first table row and the total (``#total`` = the server's count) are in the page. The
  page's own clock (an init script's MutationObserver: ``performance.now()`` from navigation start, and
  from the login's submit), the page module's own ``main.dataset.painted``, and the wall time around
  Playwright's waits. Then a click on "Older →" until page 2's rows are in, timed in the page. The
  samples alternate with the JSON calls (``alternate``).
* live: the console open on the sandbox list, sandboxes created by an open-loop pacer at a target of
  100/s (many threads) for 10 s (smoke 2). For each one, its create's 201 (``time.time()`` when the SDK
  returned) against the moment its ``tr[data-id]`` was first added to the page (a MutationObserver's
  ``performance.timeOrigin + performance.now()``: both epoch ms on this machine); rows not shown within
  10 s are counted. Beside it: the create latency at that moment, the same 201 against the event's arrival
  on a separate SSE stream of ``/aenv/events`` held by the bench (the server's part of the delay), the
  page's own list requests (Playwright's request timing) and the JSON first page polled by the bench.
* clean-up: ``DELETE /aenv/sandboxes?metadata=run=<run>``, then the server stops.

It starts its own ns server (API keys on, so the page's log-in is the real one; ``max_sandboxes`` above
the fill and the live creates; the bench's defaults: pool 4, KSM auto). Not in ``all``; run it by name::

    python -m bench --scenarios console [--smoke]

Knobs (environment): AENV_BENCH_CONSOLE_COUNT (sandboxes to fill; 2000, smoke 20), AENV_BENCH_CONSOLE_RATE
(creates/s target of the live phase; 100), AENV_BENCH_CONSOLE_LIVE_S (its length; 10, smoke 2),
AENV_BENCH_CONSOLE_SAMPLES (first-paint samples; 10, smoke 3), AENV_BENCH_CONSOLE_FLOOR (fraction of
MemTotal that must stay available while filling; 0.2: the live phase adds more, down to 0.1), AENV_BENCH_CONSOLE_KSM_WAIT (seconds to wait for
ksmd at the floor; 120, smoke 15), AENV_BENCH_CONSOLE_PAUSE_REST (1: once at the floor, the rest of the fill
is made and paused at once, each, so the list still holds N; 0: the fill stops at the floor).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from rich.console import Console

from bench.console_probe import SHOW_S, Events, schedule, show_delays, spread_note
from bench.context import Ctx
from bench.rows import Row, alternate, ms_since, row, scenario, value_row

if TYPE_CHECKING:
    from aenv.testing.server import Server

console = Console(stderr=True)
TITLE = "console: the sandbox list at 2,000 live sandboxes, first paint and live updates under creates"
PAGE = 50  # the console's page size (static/pages/sandboxes.js)
FIRST_PAGE = f"/v2/sandboxes?limit={PAGE}&state=running,paused"
CONSOLE = "aenv-ns console"  # the browser's rows; the JSON routes' rows are their baselines
LIVE_FLOOR = 0.1  # the live phase creates nothing more once MemAvailable is at most this fraction of MemTotal
LIVE_THREADS = 128

# Run in every fresh context before the page's own scripts: marks (performance.now(), ms from navigation
# start) when the login form shows, when it is submitted, when the first table row and the total are in.
INIT_JS = """
window.__bench = {};
const mark = (k) => { if (!(k in window.__bench)) window.__bench[k] = performance.now(); };
document.addEventListener("submit", () => mark("submit"), true);
new MutationObserver(() => {
  if (!("form" in window.__bench) && document.getElementById("api-key")) mark("form");
  if (!("rows" in window.__bench) && document.querySelector("#sandboxes tbody tr")) mark("rows");
  const t = document.getElementById("total");
  if (!("total" in window.__bench) && t && t.textContent !== "") { window.__bench.totalText = t.textContent; mark("total"); }
}).observe(document, { childList: true, subtree: true, characterData: true });
"""
# Page 2: click "Older →", resolve with the ms until a row other than page 1's first is in the table.
NEXT_JS = """
() => new Promise((resolve, reject) => {
  const first = document.querySelector("#sandboxes tbody tr").dataset.id;
  const t0 = performance.now();
  const done = () => {
    const tr = document.querySelector("#sandboxes tbody tr");
    if (tr && tr.dataset.id !== first) { obs.disconnect(); resolve(performance.now() - t0); return true; }
    return false;
  };
  const obs = new MutationObserver(done);
  obs.observe(document.getElementById("main"), { childList: true, subtree: true });
  document.getElementById("next-page").click();
  setTimeout(() => { obs.disconnect(); reject(new Error("page 2 not shown in 10 s")); }, 10000);
})
"""
# The live page: the epoch ms at which each data-id's row was first added (or found).
SEEN_JS = """
() => {
  window.__seen = new Map();
  const now = () => performance.timeOrigin + performance.now();
  const add = (n) => {
    if (n.nodeType !== 1) return;
    const rows = n.matches("tr[data-id]") ? [n] : n.querySelectorAll("tr[data-id]");
    for (const tr of rows) if (!window.__seen.has(tr.dataset.id)) window.__seen.set(tr.dataset.id, now());
  };
  document.querySelectorAll("tr[data-id]").forEach(add);
  new MutationObserver((ms) => { for (const m of ms) m.addedNodes.forEach(add); })
    .observe(document.getElementById("main"), { childList: true, subtree: true });
}
"""
SEEN_OF = "ids => Object.fromEntries(ids.filter((i) => window.__seen.has(i)).map((i) => [i, window.__seen.get(i)]))"


@dataclass(frozen=True)
class Knobs:
    count: int  # sandboxes to fill
    rate: float  # live creates/s, the target
    live_s: float  # seconds of live creates
    samples: int  # first-paint samples
    list_calls: int  # JSON first-page calls
    floor: float  # the fill stops once MemAvailable <= floor × MemTotal
    ksm_wait: float  # seconds to wait for ksmd at the floor
    threads: int  # fill creates at once
    pause_rest: bool = True  # at the memory floor, make the rest and pause each (else stop there)

    @classmethod
    def from_env(cls, smoke: bool, env: Mapping[str, str] = os.environ) -> Knobs:
        def get(name: str, full: float, small: float) -> float:
            raw = env.get(f"AENV_BENCH_CONSOLE_{name}", "").strip()
            return float(raw) if raw else (small if smoke else full)

        knobs = cls(count=int(get("COUNT", 2000, 20)), rate=get("RATE", 100, 100), live_s=get("LIVE_S", 10, 2),
                    samples=int(get("SAMPLES", 10, 3)), list_calls=30 if not smoke else 6,
                    floor=get("FLOOR", 0.2, 0.2), ksm_wait=get("KSM_WAIT", 120, 15), threads=3 if smoke else 4,
                    pause_rest=env.get("AENV_BENCH_CONSOLE_PAUSE_REST", "1") != "0")
        if min(knobs.count, knobs.samples) < 1 or knobs.rate <= 0 or knobs.live_s <= 0 or not 0 < knobs.floor < 1:
            raise ValueError(f"AENV_BENCH_CONSOLE_*: counts >= 1, rate and length > 0, floor in (0, 1): {knobs}")
        return knobs

    @property
    def live_creates(self) -> int:
        return max(1, round(self.rate * self.live_s))


# ---- the server's side ---------------------------------------------------------------------------------
def _sdk(url: str) -> dict[str, Any]:
    """The e2b SDK's keyword arguments for the server (or gateway) at ``url``."""
    return {"api_url": url, "sandbox_url": url, "api_key": _sdk_key()}


def _fill(srv: Server, knobs: Knobs, run: str, made: list[str]) -> tuple[list[float], str, float]:
    """``knobs.count`` sandboxes through the SDK (scale's ramp: its steps, threads and memory floor)."""
    from e2b import Sandbox

    from bench.density import after_ksm
    from bench.scale import Knobs as RampKnobs
    from bench.scale import Ramp

    kw = _sdk(srv.url)

    def create(record: Callable[[str], None]) -> float:
        t0 = time.perf_counter()
        sbx = Sandbox.create("base", metadata={"run": run}, timeout=3600, **kw)
        ms = ms_since(t0)
        record(sbx.sandbox_id)
        made.append(sbx.sandbox_id)
        return ms

    ramp = Ramp("console fill")
    rk = RampKnobs(cap=knobs.count, step=min(100, knobs.count), forks=1, docker_cap=None, ksm_wait=knobs.ksm_wait,
                   floor=knobs.floor, threads=knobs.threads)
    ramp.run(create, rk, knobs.count, dict, settle=lambda: after_ksm(srv.url, knobs.ksm_wait))
    lat = [x for step in ramp.latencies for x in step]
    reason, wall = ramp.reason, ramp.wall_s
    if len(made) < knobs.count and knobs.pause_rest:
        # At the memory floor: the rest are made and paused at once, as an RL run keeps sandboxes waiting on
        # the model (a paused ns sandbox's memory is on disk); the list shows running and paused alike.
        import httpx

        t0 = time.perf_counter()
        running = len(made)
        with httpx.Client(base_url=srv.url, headers={"X-API-KEY": _sdk_key()}, trust_env=False, timeout=300) as client:

            def create_paused(_: int) -> float:
                mine: list[str] = []
                ms = create(mine.append)
                client.post(f"/sandboxes/{mine[0]}/pause").raise_for_status()
                return ms

            with concurrent.futures.ThreadPoolExecutor(knobs.threads) as pool:
                lat += list(pool.map(create_paused, range(knobs.count - len(made))))
        wall += time.perf_counter() - t0
        reason = f"{reason}; then {len(made) - running} more made and paused at once ({running} left running)"
    return lat, reason, wall


def _json_routes(client: Any) -> dict[str, Any]:
    """The JSON routes the page reads, once each: first page, summary, metrics of its rows, page 2."""
    t0 = time.perf_counter()
    first = client.get(FIRST_PAGE)
    first_ms = ms_since(t0)
    first.raise_for_status()
    ids = [s["sandboxID"] for s in first.json() if s.get("state") == "running"]
    t0 = time.perf_counter()
    client.get("/aenv/sandboxes/summary").raise_for_status()
    summary_ms = ms_since(t0)
    metrics_ms = None
    if ids:
        t0 = time.perf_counter()
        client.get("/sandboxes/metrics", params={"sandbox_ids": ",".join(ids)}).raise_for_status()
        metrics_ms = ms_since(t0)
    token = first.headers.get("X-Next-Token")
    page2_ms = None
    if token:
        t0 = time.perf_counter()
        client.get(FIRST_PAGE, params={"nextToken": token}).raise_for_status()
        page2_ms = ms_since(t0)
    return {"first": first_ms, "summary": summary_ms, "metrics": metrics_ms, "page2": page2_ms}


def _walk(client: Any) -> tuple[float, int, int]:
    """Every page of the list through ``nextToken``: ms in all, sandboxes listed, pages."""
    t0 = time.perf_counter()
    token: str | None = None
    seen = pages = 0
    while True:
        resp = client.get(FIRST_PAGE, params={"nextToken": token} if token else None)
        resp.raise_for_status()
        seen += len(resp.json())
        pages += 1
        token = resp.headers.get("X-Next-Token")
        if not token:
            return ms_since(t0), seen, pages


# ---- the browser's side --------------------------------------------------------------------------------
@contextlib.contextmanager
def _browser() -> Iterator[Any]:
    """Debian's chromium under Playwright, with the console tests' flags (tests/fixtures/browser.py)."""
    from tests.fixtures.browser import CHROMIUM, launch

    if not Path(CHROMIUM).exists():
        raise RuntimeError(f"{CHROMIUM} is missing: scripts/setup.sh installs Debian's chromium package")
    with launch() as browser:
        yield browser


def _logged_in(browser: Any, url: str, key: str, total: int | None) -> tuple[Any, Any, float]:
    """A fresh context on ``/console``, logged in, until a table row (and the total = ``total``) shows:
    the context, its page and the wall ms from before the navigation."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    context.add_init_script(INIT_JS)
    page = context.new_page()
    t0 = time.perf_counter()
    page.goto(url + "/console")
    page.fill("#api-key", key)
    page.click("#login")
    if total is None:
        page.wait_for_selector("#sandboxes tbody tr", timeout=30_000)
    else:
        page.wait_for_function(
            "n => !!document.querySelector('#sandboxes tbody tr') && (document.getElementById('total') || {}).textContent === n",
            arg=str(total), timeout=30_000)  # fmt: skip
    return context, page, ms_since(t0)


@dataclass(frozen=True)
class Paint:
    nav: float  # page clock: navigation start → first row and the total in the page
    submit: float  # page clock: the login's submit → the same
    painted: float  # the page module's own main.dataset.painted
    wall: float  # Playwright: before goto → its wait for row + total returned
    dcl: float  # page clock: navigation start → DOMContentLoaded (the vendor scripts in <head> run by then)
    form: float  # page clock: navigation start → the log-in form in the page
    next_page: float | None  # page clock: click on "Older →" → page 2's first row in
    again: float = float("nan")  # page clock: a logged-in reload's navigation start → first row and the total


def _sample(browser: Any, url: str, key: str, total: int) -> Paint:
    context, page, wall = _logged_in(browser, url, key, total)
    try:
        marks = page.evaluate("window.__bench")
        dcl = float(page.evaluate("performance.getEntriesByType('navigation')[0].domContentLoadedEventEnd"))
        painted = float(page.evaluate("document.getElementById('main').dataset.painted || 'NaN'"))
        shown = max(marks["rows"], marks["total"])
        nxt = page.evaluate(NEXT_JS) if page.query_selector("#next-page:not([disabled])") else None
        # An operator with a session: the page again, straight to the list (no log-in form on the way).
        page.goto(url + "/console#/sandboxes")
        page.reload()
        page.wait_for_function(
            "n => !!document.querySelector('#sandboxes tbody tr') && (document.getElementById('total') || {}).textContent === n",
            arg=str(total), timeout=30_000)  # fmt: skip
        again = page.evaluate("window.__bench")
        return Paint(shown, shown - marks["submit"], painted, wall, dcl, marks["form"], nxt,
                     max(again["rows"], again["total"]))
    finally:
        context.close()


@dataclass
class Live:
    created: dict[str, float] = field(default_factory=dict)  # id → its 201, epoch ms
    latencies: list[float] = field(default_factory=list)  # each create, ms (its own call)
    lags: list[float] = field(default_factory=list)  # each create's start after its due time, ms
    failures: list[str] = field(default_factory=list)
    skipped: int = 0  # not made: the host at the live floor
    issued_s: float = 0.0  # how long the pacer took to hand out every start
    started_at: float = 0.0  # epoch ms of the pacer's start
    seen: dict[str, float] = field(default_factory=dict)  # id → first in the page, epoch ms
    page_lists: list[float] = field(default_factory=list)  # the page's own GET /v2/sandboxes, ms
    polled: list[float] = field(default_factory=list)  # the bench's GET of the first page meanwhile, ms
    lock: threading.Lock = field(default_factory=threading.Lock)


def _live(browser: Any, url: str, client: Any, key: str, knobs: Knobs, run: str, made: list[str]) -> Live:
    """The console open on the list while the pacer creates ``knobs.live_creates`` at ``knobs.rate``/s."""
    from e2b import Sandbox

    from bench.scale import meminfo

    kw = _sdk(url)
    live = Live()
    total_kb = meminfo()["MemTotal"]
    context, page, _ = _logged_in(browser, url, key, None)
    try:
        page.wait_for_timeout(2500)  # the reload the event stream's open asks for, done
        page.evaluate(SEEN_JS)

        def on_done(req: Any) -> None:
            if "/v2/sandboxes?" in req.url:
                live.page_lists.append(float(req.timing["responseEnd"]))

        page.on("requestfinished", on_done)

        def one(due: float) -> None:
            if meminfo()["MemAvailable"] <= LIVE_FLOOR * total_kb:
                with live.lock:
                    live.skipped += 1
                return
            lag = (time.monotonic() - due) * 1000
            t0 = time.perf_counter()
            try:
                sbx = Sandbox.create("base", metadata={"run": run}, timeout=3600, **kw)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                with live.lock:
                    live.failures.append(f"{type(exc).__name__}: {str(exc)[:160]}")
                return
            at, ms = time.time() * 1000, ms_since(t0)
            with live.lock:
                made.append(sbx.sandbox_id)
                live.created[sbx.sandbox_id] = at
                live.latencies.append(ms)
                live.lags.append(lag)

        def pacer() -> None:
            with concurrent.futures.ThreadPoolExecutor(LIVE_THREADS, thread_name_prefix="console-live") as pool:
                t0 = time.monotonic()
                live.started_at = time.time() * 1000
                for off in schedule(knobs.rate, knobs.live_creates):
                    if (wait := t0 + off - time.monotonic()) > 0:
                        time.sleep(wait)
                    pool.submit(one, t0 + off)
                live.issued_s = time.monotonic() - t0

        def poll() -> None:
            while pacing.is_alive():
                t0 = time.perf_counter()
                if client.get(FIRST_PAGE).status_code == 200:
                    live.polled.append(ms_since(t0))
                time.sleep(0.5)

        pacing = threading.Thread(target=pacer, name="console-pacer")
        pacing.start()
        polling = threading.Thread(target=poll, name="console-poll")
        polling.start()
        while pacing.is_alive():
            page.wait_for_timeout(250)  # the main thread pumps Playwright's events meanwhile
        polling.join()
        last = max(live.created.values(), default=time.time() * 1000)
        while time.time() * 1000 < last + SHOW_S * 1000:
            page.wait_for_timeout(500)
            if page.evaluate("ids => ids.every((i) => window.__seen.has(i))", list(live.created)):
                break
        live.seen = page.evaluate(SEEN_OF, list(live.created))
        return live
    finally:
        context.close()


# ---- the scenario ---------------------------------------------------------------------------------------
def paint_phase(browser: Any, client: Any, url: str, key: str, total: int, knobs: Knobs, system: str = CONSOLE
                ) -> list[Row]:  # fmt: skip
    """The JSON routes and the first-paint samples, alternating (after one browser sample not kept:
    chromium's first context), and the walk of every page: their rows."""
    _sample(browser, url, key, total)
    got = alternate(knobs.list_calls, [("json", lambda: _json_routes(client)),
                                       ("console", lambda: _sample(browser, url, key, total))],
                    limits={"console": knobs.samples})  # fmt: skip
    walk = _walk(client)
    return _paint_rows(cast(list[dict[str, Any]], got["json"]), cast(list[Paint], got["console"]), walk, total, system)


def _paint_rows(json_calls: list[dict[str, Any]], paints: list[Paint], walk: tuple[float, int, int], total: int,
                CONSOLE: str = CONSOLE) -> list[Row]:  # noqa: N803 - the module's name for the browser's rows
    def of(name: str) -> list[float]:
        return [c[name] for c in json_calls if c.get(name) is not None]

    json_sys = "JSON GET /v2/sandboxes?limit=50"
    nexts = [p.next_page for p in paints if p.next_page is not None]
    walk_ms, listed, pages = walk
    return [
        row("console: first page of the list", json_sys, of("first"),
            note=f"`{FIRST_PAGE}` with {total} live, the call alone (what the page's first fetch costs)"),
        row("console: first page of the list", CONSOLE, [p.nav for p in paints],
            note="page clock: navigation start → first row and `#total` = the server's count in the DOM "
                 "(log-in form, its submit and the session call included); a fresh context each"),
        row("console: first page of the list", f"{CONSOLE}, logged in", [p.again for p in paints if p.again == p.again],
            note="page clock: a reload with the session cookie, navigation start → first row and `#total` = the "
                 "server's count (what an operator who is logged in waits for)"),
        row("  console: first page, navigation → DOMContentLoaded", CONSOLE, [p.dcl for p in paints],
            note="page clock: index.html and its style sheet, before app.js runs (the browser libraries load "
                 "with the pages that use them, not this one)"),
        row("  console: first page, navigation → log-in form shown", CONSOLE, [p.form for p in paints],
            note="page clock: + app.js and its `/console/session` call"),
        row("  console: first page, log-in submit → rows + total", CONSOLE, [p.submit for p in paints],
            note="page clock: the log-in call, session, the page module's import, list + summary; the gap "
                 "between the form and the submit is Playwright's fill + click"),
        row("  console: first page, the page module's own `main.dataset.painted`", CONSOLE,
            [p.painted for p in paints], note="sandboxes.js start → first table render"),
        row("  console: first page, wall (Playwright)", CONSOLE, [p.wall for p in paints],
            note="before `goto` → the wait for row + total returned (Playwright's round trips included)"),
        row("console: summary route", "JSON GET /aenv/sandboxes/summary", of("summary")),
        row("console: metrics of the 50 rows shown", "JSON GET /sandboxes/metrics", of("metrics"),
            note="`?sandbox_ids=` the first page's running rows"),
        row("console: next page", "JSON GET /v2/sandboxes nextToken", of("page2")),
        row("console: next page", CONSOLE, nexts, note="page clock: click on “Older →” → page 2's first row in"),
        value_row("console: list all via nextToken", "JSON GET /v2/sandboxes (walk)", walk_ms, listed, "ms",
                  note=f"{listed} listed in {pages} pages of {PAGE}"),
    ]


def _live_rows(live: Live, events: Events, knobs: Knobs, server: str = "aenv-ns", CONSOLE: str = CONSOLE  # noqa: N803
               ) -> tuple[list[Row], list[str]]:
    delays, missing = show_delays(live.created, live.seen)
    sse = events.arrivals()
    sse_delays = [sse[s] - at for s, at in live.created.items() if s in sse]
    n_ok = len(live.created)
    span_s = (max(live.created.values()) - live.started_at) / 1000 if live.created else 0.0
    answered = n_ok / span_s if span_s > 0 else 0.0
    kinds: dict[str, int] = {}
    for kind, _, at in events.got:
        if at >= live.started_at:
            kinds[kind] = kinds.get(kind, 0) + 1
    reloads = len(live.page_lists)
    rows = [
        row("console live: a new sandbox", CONSOLE, delays,
            note=f"its create's 201 (bench, time.time()) → its `tr[data-id]` first added to the page "
                 f"(MutationObserver, performance.timeOrigin + now()); {len(missing)} of {n_ok} not shown within "
                 f"{SHOW_S:.0f} s (not in these samples)"),
        row("console live: a new sandbox", "SDK create latency, same creates", live.latencies,
            note=f"`Sandbox.create` call → return; start lag behind the pacer's schedule {spread_note(live.lags)}"),
        row("  console live: 201 → its event on the bench's SSE stream", server, sse_delays,
            note=f"a separate httpx stream of /aenv/events; {n_ok - len(sse_delays)} of {n_ok} without a created event"),
        row("  console live: the page's own list request", CONSOLE, live.page_lists,
            note=f"Playwright's request timing (responseEnd); {reloads} list fetches while it ran"),
        row("  console live: JSON first page, polled meanwhile", "JSON GET /v2/sandboxes?limit=50", live.polled,
            note="the bench, every 0.5 s while the pacer ran"),
        value_row("console live: creates answered", server, answered, n_ok, "/s",
                  note=f"target {knobs.rate:g}/s × {knobs.live_s:g} s = {knobs.live_creates} (open-loop pacer, "
                       f"{LIVE_THREADS} threads; all started by {live.issued_s:.1f} s); {n_ok} answered over "
                       f"{span_s:.1f} s; {len(live.failures)} failed; {live.skipped} not made (host at the live floor)"),
        value_row("console live: rows not shown within 10 s", CONSOLE, len(missing), n_ok, "count",
                  note=f"of {n_ok} created; the page reloads its 50 newest at most once a second"),
        value_row("console live: SSE events on the bench's stream", server, sum(kinds.values()),
                  sum(kinds.values()), "count",
                  note=", ".join(f"{k} {v}" for k, v in sorted(kinds.items())) + (f"; {events.error}" if events.error else "")),
    ]
    notes = []
    if live.failures:
        notes.append(f"live creates that failed: {len(live.failures)}, first: {live.failures[0]}")
    return rows, notes


def console_scale(ctx: Ctx) -> dict[str, Any]:
    """The console's sandbox list at 2,000 live sandboxes: first paint and live updates under 100 creates/s."""
    import httpx

    from aenv.testing.server import start_server, stop_server
    from bench.scale import _warm, meminfo

    if ctx.runtime != "ns":
        return scenario(TITLE, [], [f"{ctx.runtime}: console runs on ns only (the fill is scale's ramp)"])
    knobs = Knobs.from_env(ctx.smoke)
    run = "console-" + uuid.uuid4().hex[:10]
    rows: list[Row] = []
    notes = [f"issue 38's row: 2,000 live rows, first paint under 1 s, live updates while 100 creates/s arrive; "
             f"knobs: {knobs.count} to fill ({knobs.threads} at a time, memory floor {knobs.floor:.0%} of MemTotal), "
             f"live {knobs.rate:g}/s for {knobs.live_s:g} s, {knobs.samples} first-paint samples (AENV_BENCH_CONSOLE_*); "
             f"run={run}"]
    tmp = Path(tempfile.mkdtemp(prefix="aenv-bench-console-"))
    srv = start_server(tmp, "ns", {"AENV_POOL_SIZE": "4", "AENV_KSM": "auto",
                                   "AENV_API_KEYS": _sdk_key(),
                                   "AENV_MAX_SANDBOXES": str(knobs.count + knobs.live_creates + 64),
                                   # a paused fill sandbox goes to disk at once (CRIU), its memory freed
                                   "AENV_NS_RELEASE_PAUSED_AFTER": "0"})
    made: list[str] = []
    try:
        _warm(srv)
        key = _sdk_key()
        with httpx.Client(base_url=srv.url, headers={"X-API-KEY": key}, trust_env=False, timeout=120) as client:
            lat, reason, fill_s = _fill(srv, knobs, run, made)
            time.sleep(2.0)
            total = int(client.get("/aenv/sandboxes/summary").json()["total"])
            rows.append(value_row("console fill: live sandboxes", "aenv-ns", len(made), len(made), "count",
                                  note=f"stopped: {reason}; {fill_s:.0f} s ({len(made) / max(fill_s, 1e-9):.1f}/s); "
                                       f"summary total {total}; MemAvailable {meminfo()['MemAvailable'] / 1024:.0f} MB"))
            rows.append(row("console fill: create (SDK)", "aenv-ns", lat,
                            note=f"`Sandbox.create(\"base\", metadata={{run}})`, {knobs.threads} at a time"))
            with _browser() as browser:
                rows += paint_phase(browser, client, srv.url, key, total, knobs)
                with Events(srv.url, key) as events:
                    live = _live(browser, srv.url, client, key, knobs, run, made)
                    time.sleep(0.5)
                live_rows, live_notes = _live_rows(live, events, knobs)
                rows += live_rows
                notes += live_notes
            t0 = time.perf_counter()
            resp = client.delete("/aenv/sandboxes", params={"metadata": f"run={run}"}, timeout=900)
            out = resp.json().get("killed", 0) if resp.status_code == 200 else 0
            killed = len(out) if isinstance(out, list) else int(out)
            notes.append(f"clean-up: DELETE /aenv/sandboxes?metadata=run={run} killed {killed} of {len(made)} "
                         f"in {ms_since(t0) / 1000:.1f} s (HTTP {resp.status_code})")
        notes.append("the JSON calls and the browser samples alternate (30 and 10 rounds; one browser sample "
                     "before them not kept); the live phase follows on the same server, the SSE stream opened "
                     "before it")
    finally:
        if made:
            with contextlib.suppress(Exception):
                httpx.delete(srv.url + "/aenv/sandboxes", params={"metadata": f"run={run}"},
                             headers={"X-API-KEY": _sdk_key()}, trust_env=False, timeout=900)
        stop_server(srv)  # anything left goes with it (stop_sandboxes_on_exit)
        if str(tmp) not in Path("/proc/mounts").read_text():
            shutil.rmtree(tmp, ignore_errors=True)
    return scenario(TITLE, rows, notes)


def _sdk_key() -> str:
    from aenv.testing.server import API_KEY

    return os.environ.get("E2B_API_KEY", API_KEY)

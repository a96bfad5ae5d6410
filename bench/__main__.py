"""aenv benchmarks: ``python -m bench [--smoke] [--json out.json] [--runtime ns|vm] [--scenarios core,snapshots]``.

Each scenario drives a real server through the unmodified e2b SDK and prints a table; the container
baseline (docker run if the engine can be started here, else runc) is measured in the same run, alternated
with aenv's samples so machine drift affects both alike. Nothing here asserts: numbers are reported.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from aenv.testing.server import API_KEY, start_server, stop_server
from bench.baselines import container_baseline

console = Console(stderr=True)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[idx]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50_ms": round(statistics.median(values), 2) if values else float("nan"),
        "p95_ms": round(pct(values, 95), 2),
        "p99_ms": round(pct(values, 99), 2),
        "min_ms": round(min(values), 2) if values else float("nan"),
    }


def ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def scenario_create_first_command(n: int, baseline: Any) -> dict[str, Any]:
    """Sandbox.create → first commands.run("true") answered, serial; alternated with the baseline."""
    from e2b import Sandbox

    ours: list[float] = []
    theirs: list[float] = []
    for _ in range(n):
        t0 = time.perf_counter()
        sbx = Sandbox.create("base")
        sbx.commands.run("true")
        ours.append(ms_since(t0))
        sbx.kill()
        if baseline is not None:
            theirs.append(baseline.once())
    out: dict[str, Any] = {"aenv": summary(ours)}
    if baseline is not None:
        out["baseline"] = {"name": baseline.name, **summary(theirs)}
        out["speedup_p50"] = round(out["baseline"]["p50_ms"] / out["aenv"]["p50_ms"], 1)
    return out


def scenario_run_true(n: int) -> dict[str, Any]:
    from e2b import Sandbox

    sbx = Sandbox.create("base")
    try:
        sbx.commands.run("true")
        samples = []
        for _ in range(n):
            t0 = time.perf_counter()
            sbx.commands.run("true")
            samples.append(ms_since(t0))
        files = []
        payload = os.urandom(1 << 20)
        for _ in range(max(3, n // 5)):
            t0 = time.perf_counter()
            sbx.files.write("/tmp/bench.bin", payload)
            assert bytes(sbx.files.read("/tmp/bench.bin", format="bytes")) == payload
            files.append(ms_since(t0))
        return {"commands.run(true)": summary(samples), "1 MiB write+read": summary(files)}
    finally:
        sbx.kill()


def scenario_concurrent_creates(total: int, concurrency: int) -> dict[str, Any]:
    from e2b import Sandbox

    def one(_: int) -> float:
        t0 = time.perf_counter()
        sbx = Sandbox.create("base")
        sbx.commands.run("true")
        took = ms_since(t0)
        sbx.kill()
        return took

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        lat = list(pool.map(one, range(total)))
    wall = time.perf_counter() - t0
    return {"creates_per_s": round(total / wall, 1), "concurrency": concurrency, **summary(lat)}


def scenario_pause_resume(n: int) -> dict[str, Any]:
    from e2b import Sandbox

    sbx = Sandbox.create("base")
    try:
        pauses, resumes = [], []
        for _ in range(n):
            t0 = time.perf_counter()
            sbx.pause()
            pauses.append(ms_since(t0))
            t0 = time.perf_counter()
            sbx = Sandbox.connect(sbx.sandbox_id)
            sbx.commands.run("true")
            resumes.append(ms_since(t0))
        return {"pause": summary(pauses), "resume (connect + first command)": summary(resumes)}
    finally:
        sbx.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    ap.add_argument("--smoke", action="store_true", help="few iterations, for CI (under a minute)")
    ap.add_argument("--runtime", default="ns", choices=["ns", "vm"])
    ap.add_argument("--server", help="use a running server instead of starting one")
    ap.add_argument("--json", type=Path, help="write results as JSON here")
    ap.add_argument("--baseline", default="docker", choices=["docker", "runc", "none"])
    ap.add_argument("--scenarios", default="core",
                    help="comma list: core (create, round trip, concurrency, pause), snapshots (fork, snapshot, "
                         "rollback; see bench/snapshots.py) [default: core]")
    args = ap.parse_args(argv)
    scenarios = {s.strip() for s in args.scenarios.split(",") if s.strip()}
    if not scenarios <= {"core", "snapshots"}:
        ap.error(f"unknown scenarios: {', '.join(sorted(scenarios - {'core', 'snapshots'}))}")

    n = 5 if args.smoke else 40
    server = None
    if args.server:
        url = args.server.rstrip("/")
    else:
        server = start_server(Path(tempfile.mkdtemp(prefix="aenv-bench-")), args.runtime, {"AENV_POOL_SIZE": "4"})
        url = server.url
    os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=API_KEY, NO_PROXY="127.0.0.1,localhost")
    results: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, kernel {platform.release()}",
        "runtime": args.runtime,
        "mode": "smoke" if args.smoke else "full",
    }
    try:
        if "snapshots" in scenarios:
            from bench import snapshots

            results["snapshots"] = snapshots.run(url, args.smoke)
        if "core" in scenarios:
            _core(results, args, n)
    finally:
        if server is not None:
            stop_server(server)
    if "snapshots" in scenarios:
        from bench import snapshots

        Console().print(snapshots.table(results["snapshots"]))
    if "core" in scenarios:
        Console().print(_core_table(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def _core(results: dict[str, Any], args: argparse.Namespace, n: int) -> None:
    """create → first command (with the container baseline), round trip, concurrent creates, pause/resume."""
    from aenv.config import load_settings
    from aenv.images.bootstrap import ensure_base_rootfs

    rootfs = ensure_base_rootfs(load_settings())
    time.sleep(1.0)  # let the warm pool fill
    with console.status("create → first command"):
        if args.baseline == "none":
            results["create_first_command"] = scenario_create_first_command(n, None)
        else:
            with container_baseline(rootfs, prefer=args.baseline) as base:
                results["create_first_command"] = scenario_create_first_command(n, base)
    with console.status("commands.run round trip"):
        results["round_trip"] = scenario_run_true(n * 4)
    with console.status("concurrent creates"):
        results["concurrent_creates"] = scenario_concurrent_creates(16 if args.smoke else 64, 16)
    with console.status("pause / resume"):
        results["pause_resume"] = scenario_pause_resume(3 if args.smoke else 20)


def _core_table(results: dict[str, Any]) -> Table:
    table = Table(title=f"aenv bench ({results['runtime']}, {results['mode']})")
    for col in ("scenario", "p50 ms", "p95 ms", "n", "note"):
        table.add_column(col)

    def row(name: str, s: dict[str, Any], note: str = "") -> None:
        table.add_row(name, f"{s['p50_ms']:.2f}", f"{s['p95_ms']:.2f}", str(s["n"]), note)

    cf = results["create_first_command"]
    row("create → first command", cf["aenv"])
    if "baseline" in cf:
        row(f"  baseline: {cf['baseline']['name']} /bin/true", cf["baseline"], f"aenv {cf['speedup_p50']}× faster (p50)")
    for k, v in results["round_trip"].items():
        row(k, v)
    cc = results["concurrent_creates"]
    row(f"create+run+kill @ concurrency {cc['concurrency']}", cc, f"{cc['creates_per_s']} creates/s")
    for k, v in results["pause_resume"].items():
        row(k, v)
    return table


if __name__ == "__main__":
    sys.exit(main())

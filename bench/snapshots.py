"""Snapshot, fork and rollback benchmarks: ``python -m bench.snapshots [--smoke] [--json out.json]``
(or ``python -m bench --scenarios snapshots``).

* fork ×{1,4,16}: ``POST /fork`` until every child has answered a ``commands.run("true")``;
* snapshot latency against dirty data: write 0/10/100 MB in a fresh sandbox, then snapshot;
* create from a snapshot → first command (a cold start: snapshot layers cannot come from the warm pool);
* rollback: ``POST /rollback``, and until the same sandbox answers again.

All through the real server (REST for aenv's own routes, the e2b SDK for commands). Nothing asserts.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from aenv.client import AenvClient
from aenv.testing.server import API_KEY, start_server, stop_server

console = Console(stderr=True)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "n": len(values),
        "p50_ms": round(statistics.median(values), 1) if values else float("nan"),
        "max_ms": round(ordered[-1], 1) if values else float("nan"),
        "min_ms": round(ordered[0], 1) if values else float("nan"),
    }


def _answer(sandbox_id: str, url: str | None = None) -> None:
    from e2b import Sandbox

    Sandbox.connect(sandbox_id, api_url=url, sandbox_url=url).commands.run("true")  # None: the environment's


def scenario_fork(client: AenvClient, counts: list[int], reps: int, url: str | None = None) -> dict[str, Any]:
    """``url``: the server ``client`` talks to, when it is not the environment's (``--against``)."""
    from e2b import Sandbox

    src = Sandbox.create("base", timeout=600, api_url=url, sandbox_url=url)
    out: dict[str, Any] = {}
    try:
        src.commands.run("head -c 1000000 /dev/urandom > /home/user/state && true")
        for n in counts:
            walls: list[float] = []
            api: list[float] = []
            mode = None
            for _ in range(reps):
                t0 = time.perf_counter()
                res = client.fork(src.sandbox_id, n)
                api.append(_ms(t0))
                with concurrent.futures.ThreadPoolExecutor(min(n, 16)) as pool:
                    list(pool.map(lambda sid: _answer(sid, url), res.sandbox_ids))
                walls.append(_ms(t0))
                mode = res.mode
                for sid in res.sandbox_ids:
                    Sandbox.kill(sid, api_url=url, sandbox_url=url)
            out[f"x{n}"] = {"all_answering": _summary(walls), "fork_call": _summary(api), "mode": mode}
    finally:
        src.kill()
    return out


def scenario_snapshot_dirty(client: AenvClient, sizes_mb: list[int], reps: int,
                            ask: str = "filesystem") -> dict[str, Any]:
    """``ask``: the mode asked for (ns: full = files + every process, through CRIU)."""
    from e2b import Sandbox

    out: dict[str, Any] = {}
    for mb in sizes_mb:
        lat: list[float] = []
        paused: list[float] = []
        size = 0
        mode = ask
        for _ in range(reps):
            sbx = Sandbox.create("base", timeout=600)
            try:
                if mb:
                    sbx.commands.run(f"head -c {mb * 1000000} /dev/urandom > /home/user/dirty", timeout=300)
                t0 = time.perf_counter()
                snap = client.snapshot(sbx.sandbox_id, mode=ask)
                lat.append(_ms(t0))
                mode = snap.mode
                size = client.wait_written(snap.snapshot_id).size_bytes  # vm: files follow the call
                if snap.paused_ms is not None:
                    paused.append(snap.paused_ms)
            finally:
                sbx.kill()
            client.delete_snapshot(snap.snapshot_id)
        out[f"{mb} MB"] = {**_summary(lat), "snapshot_mb": round(size / 1e6, 1), "paused": paused, "mode": mode}
    return out


def scenario_create_and_rollback(client: AenvClient, reps: int, ask: str = "filesystem") -> dict[str, Any]:
    from e2b import Sandbox

    sbx = Sandbox.create("base", timeout=600)
    created: list[float] = []
    rb_api: list[float] = []
    rb_answer: list[float] = []
    try:
        sbx.files.write("/home/user/v", "1")
        snap = client.snapshot(sbx.sandbox_id, mode=ask)
        for _ in range(reps):
            t0 = time.perf_counter()
            child = Sandbox.create(snap.snapshot_id, timeout=600)
            child.commands.run("true")
            created.append(_ms(t0))
            child.kill()
        for _ in range(reps):
            sbx.files.write("/home/user/v", "2")
            t0 = time.perf_counter()
            client.rollback(sbx.sandbox_id, snap.snapshot_id)
            rb_api.append(_ms(t0))
            sbx.commands.run("true")
            rb_answer.append(_ms(t0))
    finally:
        sbx.kill()
    client.delete_snapshot(snap.snapshot_id)
    return {
        "create from snapshot → first command": _summary(created),
        "rollback call": _summary(rb_api),
        "rollback → first command": _summary(rb_answer),
    }


def run(url: str, smoke: bool) -> dict[str, Any]:
    """Run every snapshot scenario against the server at ``url`` (E2B_* env must point there)."""
    reps = 1 if smoke else 5
    with AenvClient(url, os.environ.get("E2B_API_KEY", API_KEY)) as client:
        with console.status("fork ×1/4/16"):
            fork = scenario_fork(client, [1, 4, 16], reps)
        with console.status("snapshot vs dirty MB"):
            dirty = scenario_snapshot_dirty(client, [0, 10, 100], reps)
        with console.status("create from snapshot, rollback"):
            other = scenario_create_and_rollback(client, 3 if smoke else 10)
    return {"fork": fork, "snapshot_vs_dirty": dirty, **other}


def table(results: dict[str, Any]) -> Table:
    t = Table(title="aenv snapshots / fork / rollback")
    for col in ("scenario", "p50 ms", "max ms", "n", "note"):
        t.add_column(col)
    for k, v in results["fork"].items():
        s = v["all_answering"]
        t.add_row(f"fork {k} → all children answer", f"{s['p50_ms']:.1f}", f"{s['max_ms']:.1f}", str(s["n"]),
                  f"mode {v['mode']}; fork call p50 {v['fork_call']['p50_ms']:.1f} ms")
    for k, s in results["snapshot_vs_dirty"].items():
        t.add_row(f"snapshot, {k} dirty", f"{s['p50_ms']:.1f}", f"{s['max_ms']:.1f}", str(s["n"]),
                  f"snapshot size {s['snapshot_mb']} MB")
    for k in ("create from snapshot → first command", "rollback call", "rollback → first command"):
        s = results[k]
        t.add_row(k, f"{s['p50_ms']:.1f}", f"{s['max_ms']:.1f}", str(s["n"]), "")
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.snapshots", description=__doc__)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--runtime", default="ns", choices=["ns", "vm"])
    ap.add_argument("--server", help="use a running server instead of starting one")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    server = None
    if args.server:
        url = args.server.rstrip("/")
    else:
        server = start_server(Path(tempfile.mkdtemp(prefix="aenv-bench-")), args.runtime, {"AENV_POOL_SIZE": "4"})
        url = server.url
    os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=os.environ.get("E2B_API_KEY", API_KEY),
                      NO_PROXY="127.0.0.1,localhost")
    try:
        results = run(url, args.smoke)
    finally:
        if server is not None:
            stop_server(server)
    results["runtime"] = args.runtime
    Console().print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    else:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

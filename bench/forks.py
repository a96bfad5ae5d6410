"""Snapshot vs dirty MB, fork ×{1,4,16} and rollback, in the suite's row shape.

The aenv side is ``bench/snapshots.py`` (its scenario functions, one repetition per call so the
container baseline can be sampled in between); the docker side does the same job with ``docker commit``
(+ ``docker run`` of the committed image for a fork). Docker has no memory snapshot and no rollback in
place: its fork copies files only, which the notes say.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import time
import uuid
from typing import Any

from aenv.client import AenvClient, ApiError
from aenv.testing.server import API_KEY
from bench import snapshots
from bench.baselines import DockerBaseline
from bench.context import Ctx
from bench.rows import ms_since, row, scenario

DIRTY_MB = (0, 10, 100)
FORK_COUNTS = (1, 4, 16)


def _docker_commit_dirty(docker: DockerBaseline, mb: int) -> float:
    cid = docker.start_idle()
    tag = f"aenv-bench-dirty:{uuid.uuid4().hex[:8]}"
    try:
        if mb:
            docker.exec_(cid, f"head -c {mb * 1000000} /dev/urandom > /tmp/dirty")
        t0 = time.perf_counter()
        docker.commit(cid, tag)
        return ms_since(t0)
    finally:
        docker.remove(cid)
        docker.remove_image(tag)


def snapshot_dirty(ctx: Ctx) -> dict[str, Any]:
    """Snapshot (mode filesystem asked; the vm runtime always takes a full one) of a sandbox with
    0/10/100 MB written vs `docker commit`."""
    reps = ctx.n(1, 5, vm=3)
    ours: dict[int, list[float]] = {mb: [] for mb in DIRTY_MB}
    full: dict[int, list[float]] = {mb: [] for mb in DIRTY_MB}  # ns with CRIU: files + processes
    paused: dict[int, list[float]] = {mb: [] for mb in DIRTY_MB}
    theirs: dict[int, list[float]] = {mb: [] for mb in DIRTY_MB}
    sizes: dict[int, float] = {}
    modes: dict[int, str] = {}
    asks = ("aenv", "aenv-full") if ctx.runtime == "ns" else ("aenv",)
    no_full: set[int] = set()  # sizes whose full snapshot the server refused (409: no CRIU)
    full_failed: dict[int, list[str]] = {}  # failures are reported in the row's note, never dropped
    for i in range(reps):
        for mb in DIRTY_MB:
            steps = [(w, mb) for w in (*asks, "docker")]
            for who, size in steps if i % 2 == 0 else reversed(steps):
                if who == "aenv":
                    r = snapshots.scenario_snapshot_dirty(ctx.client, [size], 1)[f"{size} MB"]
                    ours[size].append(r["p50_ms"])
                    paused[size] += r.get("paused", [])
                    sizes[size] = r["snapshot_mb"]
                    modes[size] = r.get("mode", "filesystem")
                elif who == "aenv-full" and size not in no_full:
                    try:
                        full[size].append(snapshots.scenario_snapshot_dirty(ctx.client, [size], 1, "full")
                                          [f"{size} MB"]["p50_ms"])
                    except Exception as exc:  # noqa: BLE001 - a 409 where CRIU is absent (no row); else counted
                        if isinstance(exc, ApiError) and exc.status == 409 and not full[size]:
                            no_full.add(size)
                        else:
                            full_failed.setdefault(size, []).append(f"{type(exc).__name__}: {str(exc)[:200]}")
                elif (docker := ctx.heavy_docker()) is not None:
                    theirs[size].append(_docker_commit_dirty(docker, size))
    rows = []
    for mb in DIRTY_MB:
        rows.append(row(f"snapshot, {mb} MB dirty", ctx.system, ours[mb],
                        note=f"mode {modes.get(mb, 'filesystem')}, snapshot {sizes.get(mb, 0)} MB"))
        if full[mb] or full_failed.get(mb):
            failed = full_failed.get(mb, [])
            note = "mode full: CRIU dump of every process + the files"
            if failed:
                note += f"; {len(failed)} of {len(failed) + len(full[mb])} FAILED, first: {failed[0]}"
            rows.append(row(f"snapshot full (processes too), {mb} MB dirty", ctx.system, full[mb], note=note))
        if paused[mb]:
            rows.append(row(f"snapshot, {mb} MB dirty: sandbox stopped for", ctx.system, paused[mb],
                            note="`pausedMs` of the snapshot: vCPUs stopped until they run again"))
        if theirs[mb]:
            rows.append(row(f"snapshot, {mb} MB dirty", "docker", theirs[mb], note="`docker commit`"))
    return scenario("snapshot latency against dirty data", rows)


def _docker_fork(docker: DockerBaseline, n: int) -> float:
    """Commit a prepared container, then start ``n`` containers of it until each answers an exec."""
    src = docker.start_idle()
    tag = f"aenv-bench-fork:{uuid.uuid4().hex[:8]}"
    kids: list[str] = []
    try:
        docker.exec_(src, "head -c 1000000 /dev/urandom > /tmp/state")

        def child(_: int) -> str:
            cid = docker.start_idle(tag)
            docker.docker("exec", cid, "true")
            return cid

        t0 = time.perf_counter()
        docker.commit(src, tag)
        with concurrent.futures.ThreadPoolExecutor(min(n, 16)) as pool:
            kids = list(pool.map(child, range(n)))
        return ms_since(t0)
    finally:
        docker.remove(src, *kids)
        docker.remove_image(tag)


def fork(ctx: Ctx) -> dict[str, Any]:
    """Fork ×{1,4,16} until every child answers vs the commit before (``--against``) and `docker commit`
    + `docker run` ×n, each repetition in alternating order."""
    reps = ctx.n(1, 5, vm=3)
    theirs: dict[int, list[float]] = {n: [] for n in FORK_COUNTS}
    with contextlib.ExitStack() as stack:
        # (row label, client, server URL for the SDK: None = the environment's) of each aenv forked
        forkers: list[tuple[str, AenvClient, str | None]] = [(ctx.system, ctx.client, None)]
        if (prev := ctx.previous) is not None:
            key = os.environ.get("E2B_API_KEY", API_KEY)
            forkers.append((prev.system, stack.enter_context(AenvClient(prev.url, key)), prev.url))
        walls: dict[str, dict[int, list[float]]] = {system: {n: [] for n in FORK_COUNTS} for system, _, _ in forkers}
        calls: dict[str, dict[int, list[float]]] = {system: {n: [] for n in FORK_COUNTS} for system, _, _ in forkers}
        modes: dict[str, str | None] = {}
        for i in range(reps):
            for n in FORK_COUNTS:
                order: list[tuple[str, AenvClient, str | None] | None] = [*forkers, None]  # None: docker
                for who in order if i % 2 == 0 else order[::-1]:
                    if who is None:
                        if (docker := ctx.heavy_docker()) is not None:
                            theirs[n].append(_docker_fork(docker, n))
                        continue
                    system, client, url = who
                    r = snapshots.scenario_fork(client, [n], 1, url=url)[f"x{n}"]
                    walls[system][n].append(r["all_answering"]["p50_ms"])
                    calls[system][n].append(r["fork_call"]["p50_ms"])
                    modes[system] = r["mode"]
    rows = []
    for n in FORK_COUNTS:
        for system, _, _ in forkers:
            rows.append(row(f"fork ×{n} → all children answer", system, walls[system][n],
                            note=f"mode {modes.get(system)}"))
            rows.append(row(f"fork ×{n}: the fork call", system, calls[system][n]))
        if theirs[n]:
            rows.append(row(f"fork ×{n} → all children answer", "docker", theirs[n],
                            note="`docker commit` + `docker run` ×n + exec (files only)"))
    return scenario("fork a running sandbox into n children", rows,
                    [f"aenv fork mode on {ctx.runtime}: {modes.get(ctx.system)} (filesystem = files copied, processes not)"])


def rollback(ctx: Ctx) -> dict[str, Any]:
    """Rollback in place, and create from a snapshot → first command (no docker equivalent)."""
    r = snapshots.scenario_create_and_rollback(ctx.client, ctx.n(3, 10, vm=5))

    def from_summary(metric: str, s: dict[str, Any]) -> dict[str, Any]:
        # bench/snapshots.py keeps n, p50, min and max only: the p95/p99 columns show the max
        return {"metric": metric, "system": ctx.system, "unit": "ms", "n": int(s["n"]), "p50": s["p50_ms"],
                "p95": s["max_ms"], "p99": s["max_ms"], "min": s["min_ms"], "max": s["max_ms"],
                "note": "p95/p99 = max"}

    keys = ("create from snapshot → first command", "rollback call", "rollback → first command")
    rows = [from_summary(k, r[k]) for k in keys]
    if ctx.runtime == "ns":  # to a full snapshot: processes restored by CRIU (409 where it is absent: no rows)
        try:
            f = snapshots.scenario_create_and_rollback(ctx.client, ctx.n(3, 10, vm=5), "full")
            rows += [from_summary(f"{k} (full snapshot)", f[k]) for k in keys]
        except ApiError as exc:  # anything else fails the scenario, which the report shows
            if exc.status != 409:
                raise
    return scenario("rollback in place and create from a snapshot", rows, ["docker has no rollback in place"])


def released_resume(ctx: Ctx) -> dict[str, Any]:
    """ns with CRIU: pause → released to disk (processes dumped and ended) → connect + first command.

    Its own server (``ns_release_paused_after`` 0, so every pause is released at once; the main
    server's default of 300 s would make the other pause rows releases too); no docker equivalent."""
    import tempfile
    from pathlib import Path

    from e2b import Sandbox

    from aenv.runtime.ns import criu
    from aenv.testing.server import API_KEY, start_server, stop_server

    title = "resume of a paused sandbox released to disk"
    if ctx.runtime != "ns" or not criu.probe().usable:
        return scenario(title, [], [f"{ctx.runtime}: no release to disk with CRIU here"])
    samples: list[float] = []
    with tempfile.TemporaryDirectory(prefix="aenv-bench-released-") as tmp:
        srv = start_server(Path(tmp), "ns", extra_env={"AENV_NS_RELEASE_PAUSED_AFTER": "0", "AENV_POOL_SIZE": "1"})
        kw: dict[str, Any] = {"api_url": srv.url, "sandbox_url": srv.url, "api_key": API_KEY}
        try:
            for _ in range(ctx.n(2, 9)):
                sbx = Sandbox.create("base", timeout=600, **kw)
                try:
                    sbx.commands.run("sleep 3600", background=True)  # a process that must come back
                    sbx.pause()
                    marker = Path(tmp) / "state" / "sandboxes" / sbx.sandbox_id / "ns" / "released" / "released.json"
                    deadline = time.monotonic() + 60
                    while not marker.exists() and time.monotonic() < deadline:
                        time.sleep(0.05)
                    time.sleep(0.5)  # the release ends the processes after the marker
                    t0 = time.perf_counter()
                    again = Sandbox.connect(sbx.sandbox_id, **kw)
                    again.commands.run("true")
                    samples.append(ms_since(t0))
                    assert "sleep 3600" in again.commands.run("ps -eo args").stdout
                finally:
                    Sandbox.kill(sbx.sandbox_id, **kw)
        finally:
            stop_server(srv)
    return scenario(title, [row("released resume → first command", ctx.system, samples,
                                note="CRIU restore from disk, processes back")])

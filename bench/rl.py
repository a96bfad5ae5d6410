"""The RL-shaped loop, timed end to end: prepare a state (write files, start a background process), fork
it into 16 children, run a scoring command in each, keep the best child, kill the others.

The docker baseline does the same with what docker has: prepare a container, ``docker commit``, start 16
containers of the image, ``docker exec`` the score in each, keep the best, ``docker rm -f`` the rest. A
committed image carries files only, so the background process is not running in docker's children; the
row notes say, for both systems, how many children still had it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
import uuid
from typing import Any

from bench.context import Ctx
from bench.rl_groups import best_of_prepared, grpo_capacity
from bench.rows import ms_since, row, scenario

CHILDREN = 16
STATE_FILES = 8
# Prints a score; the second line says whether the prepared background process is still alive.
SCORE = (
    "cat /tmp/task/*.json | sha256sum > /dev/null; od -An -N4 -tu4 /dev/urandom | tr -d ' '; "
    "if [ -e /proc/$(cat /tmp/task/worker.pid)/stat ]; then echo alive; else echo gone; fi"
)
WORKER = "sh -c 'echo $$ > /tmp/task/worker.pid; while :; do sleep 1; done'"


def _parse(out: str) -> tuple[int, bool]:
    lines = out.split()
    return int(lines[0]), lines[1] == "alive"


def _aenv_loop(ctx: Ctx) -> dict[str, Any]:
    from e2b import Sandbox

    t0 = time.perf_counter()
    src = Sandbox.create("base", timeout=600)
    children: list[str] = []
    try:
        src.files.write_files([{"path": f"/tmp/task/{i}.json", "data": f'{{"step": {i}, "obs": "{"x" * 4000}"}}'}
                               for i in range(STATE_FILES)])  # fmt: skip
        src.commands.run(WORKER, background=True)
        src.commands.run("for i in 1 2 3 4 5 6 7 8 9 10; do [ -s /tmp/task/worker.pid ] && break; sleep 0.05; done")
        t_prep = time.perf_counter()
        res = ctx.client.fork(src.sandbox_id, CHILDREN)
        children = list(res.sandbox_ids)
        if len(children) != CHILDREN:
            raise RuntimeError(f"fork gave {len(children)}/{CHILDREN} children: {res.errors[:3]}")
        t_fork = time.perf_counter()

        def score(sid: str) -> tuple[str, int, bool]:
            out = Sandbox.connect(sid).commands.run(SCORE).stdout
            return (sid, *_parse(out))

        with concurrent.futures.ThreadPoolExecutor(CHILDREN) as pool:
            scores = list(pool.map(score, children))
        t_score = time.perf_counter()
        best = max(scores, key=lambda s: s[1])[0]
        rest = [sid for sid in children if sid != best]
        with concurrent.futures.ThreadPoolExecutor(CHILDREN) as pool:
            list(pool.map(Sandbox.kill, rest))
        t_end = time.perf_counter()
        children = [best]
        return {
            "total": ms_since(t0), "prepare": (t_prep - t0) * 1000, "fork": (t_fork - t_prep) * 1000,
            "score": (t_score - t_fork) * 1000, "kill": (t_end - t_score) * 1000,
            "alive": sum(1 for s in scores if s[2]), "mode": res.mode,
            "distinct": len({s[1] for s in scores}),
        }  # fmt: skip
    finally:
        for sid in children:
            with contextlib.suppress(Exception):
                Sandbox.kill(sid)
        with contextlib.suppress(Exception):
            src.kill()


def _docker_loop(ctx: Ctx) -> dict[str, Any]:
    docker = ctx.heavy_docker()
    assert docker is not None
    tag = f"aenv-bench-rl:{uuid.uuid4().hex[:8]}"
    t0 = time.perf_counter()
    src = docker.start_idle()
    kids: list[str] = []
    try:
        obs = "x" * 4000
        docker.exec_(src, f"mkdir -p /tmp/task && for i in $(seq 0 {STATE_FILES - 1}); do "
                          f"printf '{{\"step\": %s, \"obs\": \"{obs}\"}}' $i > /tmp/task/$i.json; done")
        docker.docker("exec", "-d", src, "sh", "-c", WORKER)
        docker.exec_(src, "for i in 1 2 3 4 5 6 7 8 9 10; do [ -s /tmp/task/worker.pid ] && break; sleep 0.05; done")
        t_prep = time.perf_counter()
        docker.commit(src, tag)

        def start(_: int) -> str:
            return docker.start_idle(tag)

        with concurrent.futures.ThreadPoolExecutor(CHILDREN) as pool:
            kids = list(pool.map(start, range(CHILDREN)))
        t_fork = time.perf_counter()

        def score(cid: str) -> tuple[str, int, bool]:
            return (cid, *_parse(docker.exec_(cid, SCORE)))

        with concurrent.futures.ThreadPoolExecutor(CHILDREN) as pool:
            scores = list(pool.map(score, kids))
        t_score = time.perf_counter()
        best = max(scores, key=lambda s: s[1])[0]
        docker.remove(*[c for c in kids if c != best])
        t_end = time.perf_counter()
        kids = [best]
        return {
            "total": ms_since(t0), "prepare": (t_prep - t0) * 1000, "fork": (t_fork - t_prep) * 1000,
            "score": (t_score - t_fork) * 1000, "kill": (t_end - t_score) * 1000,
            "alive": sum(1 for s in scores if s[2]), "mode": "commit + run",
            "distinct": len({s[1] for s in scores}),
        }  # fmt: skip
    finally:
        docker.remove(src, *kids)
        docker.remove_image(tag)


def rl_loop(ctx: Ctx) -> dict[str, Any]:
    """Prepare a state, fork 16, score each, keep the best, kill the rest (docker: commit + run); a GRPO step
    (N prompts × 16 forks) at capacity; best-of-16 by fork vs 16 cold creates on a preparation-heavy task."""
    systems: list[tuple[str, Any]] = [(ctx.system, _aenv_loop)]
    if ctx.heavy_docker() is not None:
        systems.append(("docker", _docker_loop))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in systems}
    for i in range(ctx.n(1, 5, vm=3)):
        for name, fn in systems if i % 2 == 0 else list(reversed(systems)):
            runs[name].append(fn(ctx))
    rows = []
    for name, _ in systems:
        rs = runs[name]
        alive = min(r["alive"] for r in rs)
        note = (f"fork mode {rs[-1]['mode']}; background process alive in {alive}/{CHILDREN} children; "
                f"{min(r['distinct'] for r in rs)}/{CHILDREN} distinct scores")
        rows.append(row(f"RL loop (prepare, fork {CHILDREN}, score, keep best)", name, [r["total"] for r in rs],
                        note=note))
        for phase in ("prepare", "fork", "score", "kill"):
            label = {"fork": f"  fork ×{CHILDREN} (until created)", "score": f"  score ×{CHILDREN}",
                     "kill": f"  kill {CHILDREN - 1}", "prepare": "  prepare (create, files, process)"}[phase]
            rows.append(row(label, name, [r[phase] for r in rs]))
    rows += grpo_capacity(ctx)
    rows += best_of_prepared(ctx)
    return scenario(f"RL-shaped loop: best of {CHILDREN}", rows)


def rl_groups(ctx: Ctx) -> dict[str, Any]:
    """The ``rl`` scenario's group rows alone (GRPO step at capacity, best-of-16 by fork vs cold), for a
    re-measure without the loop's five samples."""
    return scenario(f"RL groups: GRPO step and best of {CHILDREN}", grpo_capacity(ctx) + best_of_prepared(ctx))

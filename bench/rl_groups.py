"""The RL scenario's group rows, through ``aenv.rl`` and ``examples/grpo_loop.py`` as a trainer would use them:

- a GRPO-shaped step at the node's capacity: N prompts × 16 forks of one prepared state each, all groups at
  once, with its wall time, rollouts per second and failure rate (infrastructure failures / rollouts);
- best-of-16 on a preparation-heavy task: prepare once and fork 16 ways, against 16 cold creates that each
  redo the preparation. The preparation is an install's CPU-bound half, on every core: copy a package
  tree (the sandbox's own Python standard library) and byte-compile it at three optimisation levels with
  ``compileall -j0``, as ``pip install`` does after unpacking. Its own cost (in one sandbox) is stated
  in the row's note, since the ratio depends on it; on a machine with C cores, 16 cold preparations
  cost about 16 / C of them in wall time at best, while the forked variant pays for one.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aenv.rl import INFRA_FAILED, Episode, run_group
from bench.context import Ctx
from bench.rows import Row, row, value_row
from examples import grpo_loop

GROUP = 16
SMOKE_GROUP = 4  # --smoke: the same code paths in a few seconds
# What the preparation byte-compiles, per runtime: (copies of the tree, the tree under the stdlib or "").
# vm guests run under TCG here (no KVM), about ten times slower: one copy of a few packages there.
PREP = {"ns": (2, ""), "vm": (1, "email json http"), "smoke": (1, "json")}


def prepare_command(copies: int, packages: str) -> str:
    """Copy the stdlib (or ``packages`` of it) ``copies`` times and byte-compile every copy on every core."""
    lib = "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()[\"stdlib\"])')"
    src = " ".join(f"{lib}/{p}" for p in packages.split()) if packages else f"{lib}/."
    return (f"{grpo_loop.prepare_command(0)} && for c in $(seq 1 {copies}); do mkdir -p $HOME/.deps/$c && "
            f"cp -r {src} $HOME/.deps/$c/ && find $HOME/.deps/$c -name __pycache__ -prune -exec rm -rf {{}} + ; done"
            f" && python3 -m compileall -q -f -j0 -o0 -o1 -o2 $HOME/.deps > /dev/null")


def grpo_capacity(ctx: Ctx) -> list[Row]:
    prompts, group = ctx.n(1, 6, vm=2), SMOKE_GROUP if ctx.smoke else GROUP
    rounds = ctx.n(1, 2, vm=1)
    walls: list[float] = []
    rollouts = failures = 0
    mode = None
    for _ in range(rounds):
        res = grpo_loop.grpo_step(prompts, group, run=f"bench-grpo-{uuid.uuid4().hex[:6]}")
        walls.append(res.wall_s * 1000)
        rollouts += res.rollouts
        failures += res.infra_failures + sum(1 for g in res.groups for s in g.scores if s is None)
        mode = res.groups[0].fork_mode
    per_s = rollouts / (sum(walls) / 1000)
    label = f"GRPO step: {prompts} prompts × {group} forks, all at once"
    note = (f"{prompts * (group + 1)} sandboxes live at the peak; failed rollouts {failures}/{rollouts} "
            f"({100 * failures / rollouts:.1f} %); fork mode {mode}")
    return [row(label, ctx.system, walls, note=note),
            value_row("  rollouts per second", ctx.system, per_s, len(walls), "/s")]


def _prepare(command: str, spent: list[float]) -> Any:
    def prep(ep: Episode) -> None:
        t0 = time.perf_counter()
        r = ep.run(command, timeout=900)
        if r.exit_code != 0:
            raise RuntimeError(f"preparation failed: {r.stderr[:300]}")
        spent.append((time.perf_counter() - t0) * 1000)
    return prep


def _forked(group: int, command: str, spent: list[float]) -> float:
    t0 = time.perf_counter()
    res = run_group("base", group, grpo_loop.rollout(0), prepare=_prepare(command, spent), keep=1,
                    run=f"bench-best-{uuid.uuid4().hex[:6]}", timeout=600)
    ms = (time.perf_counter() - t0) * 1000
    _kill(res.kept)
    if any(m.outcome.status == INFRA_FAILED for m in res.members):
        raise RuntimeError(f"forked best-of-{group}: {[m.outcome.error for m in res.members if m.outcome.error]}")
    return ms


def _cold(group: int, command: str) -> float:
    run = f"bench-cold-{uuid.uuid4().hex[:6]}"
    score = grpo_loop.rollout(0)
    ignored: list[float] = []

    def one(i: int) -> float:
        ep = Episode("base", rollout_id=f"{run}-{i}", run=run, timeout=900, suppress_infra=False)
        with ep:
            _prepare(command, ignored)(ep)
            ep.score = float(score(ep, i))
        return ep.score or 0.0

    t0 = time.perf_counter()
    with ThreadPoolExecutor(group) as pool:
        scores = list(pool.map(one, range(group)))
    max(scores)  # the best is kept in the forked variant; here every sandbox already ended with its episode
    return (time.perf_counter() - t0) * 1000


def _kill(ids: list[str]) -> None:
    from e2b import Sandbox

    for sid in ids:
        Sandbox.kill(sid)


def best_of_prepared(ctx: Ctx) -> list[Row]:
    group = SMOKE_GROUP if ctx.smoke else GROUP
    copies, packages = PREP["smoke" if ctx.smoke else ctx.runtime]
    command = prepare_command(copies, packages)
    spent: list[float] = []
    forked: list[float] = []
    cold: list[float] = []
    for i in range(ctx.n(1, 3, vm=1)):
        order: list[tuple[str, Callable[[], None]]] = [("fork", lambda: forked.append(_forked(group, command, spent))),
                                                     ("cold", lambda: cold.append(_cold(group, command)))]
        for _, fn in order if i % 2 == 0 else reversed(order):
            fn()
    prep = sorted(spent)[len(spent) // 2]
    what = f"{packages} of the stdlib" if packages else "the stdlib"
    label = f"best of {group}, preparation byte-compiles {copies}× {what} on every core"
    return [
        row(f"{label}: prepare once + fork {group}", ctx.system, forked,
            note=f"the preparation alone: {prep / 1000:.2f} s in one sandbox (p50 of {len(spent)})"),
        row(f"{label}: {group} cold creates, each prepares", ctx.system, cold,
            note=f"{sorted(cold)[len(cold) // 2] / sorted(forked)[len(forked) // 2]:.1f}× the forked variant"),
    ]

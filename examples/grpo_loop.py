"""A GRPO-shaped loop over aenv.rl: N prompts, each prepared once and forked into a group of G (16)
rollouts from that one state, scored, group-relative advantages computed, the best child kept.

    E2B_API_URL=http://127.0.0.1:8000 E2B_API_KEY=... python -m examples.grpo_loop [prompts] [group]

What a GRPO trainer does per step is: for each prompt, sample G completions, score each, normalise the
scores within the group (advantage = (r - mean) / std) and drop the members whose failure was the
infrastructure's, not the policy's. With one sandbox per completion, the prompt's environment set-up
(a repository checkout, a dependency install, a warmed service) is paid G times; here it is paid once
per prompt and ``aenv.rl.run_group`` forks the prepared sandbox G ways (``POST /sandboxes/{id}/fork``).
The policy is scripted (no model): member i guesses the task's answer with an error that depends on its
seed, so the scores of a group differ and there is a best to keep. ``prepare_mb`` makes the preparation
heavy (that many MB written into the sandbox, as an install would), which is what the bench's ``rl``
scenario compares with G cold creates that each redo it.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aenv.rl import INFRA_FAILED, Episode, GroupResult, run_group

GROUP = 16


def prepare_command(prompt: int, prepare_mb: int = 0) -> str:
    """Lay out prompt ``prompt``'s task, plus ``prepare_mb`` MB of 'installed' files (the heavy part)."""
    heavy = (f" && mkdir -p $HOME/.deps && for i in $(seq 1 {max(1, prepare_mb // 16)}); do "
             f"head -c {min(16, prepare_mb)}M /dev/urandom > $HOME/.deps/pkg$i.bin; done") if prepare_mb else ""
    return f"mkdir -p /tmp/task && echo {answer(prompt)} > /tmp/task/.answer{heavy}"


def answer(prompt: int) -> int:
    return (prompt * 37 + 11) % 100


def policy(prompt: int, member: int) -> int:
    """The scripted policy's guess: off by a seeded error, exact for about a quarter of the members."""
    rng = random.Random(prompt * 1000 + member)
    return answer(prompt) + (0 if rng.random() < 0.25 else rng.randint(-20, 20))


def rollout(prompt: int) -> Any:
    def one(ep: Episode, member: int) -> float:
        ep.run(f"echo {policy(prompt, member)} > /tmp/task/guess")
        # Reward computed in the sandbox, from the state the fork carried over: 1 when exact.
        out = ep.run("echo $(( 100 - ( $(cat /tmp/task/guess) - $(cat /tmp/task/.answer) ) ** 2 ))").stdout
        return max(0.0, float(out.strip())) / 100
    return one


def advantages(scores: list[float | None]) -> list[float | None]:
    """Group-relative advantages; an infrastructure-failed member (None) is masked out of the group."""
    valid = [s for s in scores if s is not None]
    if len(valid) < 2:
        return [0.0 if s is not None else None for s in scores]
    mean, std = statistics.fmean(valid), statistics.pstdev(valid) or 1.0
    return [round((s - mean) / std, 4) if s is not None else None for s in scores]


@dataclass
class StepResult:
    groups: list[GroupResult]
    wall_s: float
    advantages: list[list[float | None]] = field(default_factory=list)

    @property
    def rollouts(self) -> int:
        return sum(len(g.members) for g in self.groups)

    @property
    def infra_failures(self) -> int:
        return sum(1 for g in self.groups for m in g.members if m.outcome.status == INFRA_FAILED)

    @property
    def best(self) -> list[float | None]:
        return [max((s for s in g.scores if s is not None), default=None) for g in self.groups]


def grpo_step(prompts: int, group: int = GROUP, *, prepare_mb: int = 0, concurrency: int | None = None,
              run: str | None = None, template: str = "base", keep_best: bool = False) -> StepResult:
    """One step: ``prompts`` groups of ``group`` forks, ``concurrency`` groups at a time (all by default).
    The best child of each group is kept by ``run_group`` and, unless ``keep_best``, killed at the end."""
    run = run or f"grpo-{uuid.uuid4().hex[:8]}"
    t0 = time.monotonic()

    def one(p: int) -> GroupResult:
        return run_group(template, group, rollout(p), keep=1, run=run, group_id=f"{run}-p{p}", timeout=120,
                         prepare=lambda ep: ep.run(prepare_command(p, prepare_mb)))

    with ThreadPoolExecutor(concurrency or prompts) as pool:
        groups = list(pool.map(one, range(prompts)))
    result = StepResult(groups, round(time.monotonic() - t0, 3), [advantages(g.scores) for g in groups])
    if not keep_best:
        from e2b import Sandbox

        for g in groups:
            for sid in g.kept:
                Sandbox.kill(sid)
    return result


def main(prompts: int = 2, group: int = GROUP, prepare_mb: int = 0) -> StepResult:
    res = grpo_step(prompts, group, prepare_mb=prepare_mb)
    for p, (g, adv) in enumerate(zip(res.groups, res.advantages, strict=True)):
        print(f"prompt {p}: best {max((s for s in g.scores if s is not None), default=None)} "
              f"kept {g.kept} fork {g.fork_mode} prepare {g.metrics['prepare_s']}s fork {g.metrics['fork_s']}s; "
              f"advantages {adv}")
    print(f"{res.rollouts} rollouts in {res.wall_s}s, {res.infra_failures} infrastructure failures")
    return res


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    main(*args)

"""A SkyRL-Gym text environment whose tool calls run in an aenv sandbox (``pip install 'skyrl-gym>=0.4,<0.5'``).

    E2B_API_URL=http://127.0.0.1:8000 E2B_API_KEY=... python -m examples.skyrl_gym_env [episodes]

Why SkyRL-Gym (of the frameworks pip installs here): its ``BaseTextEnv`` is exactly the shape of a
sandboxed rollout: ``init(prompt)`` opens the episode, ``step(llm_text) -> {observations, reward, done}``
runs one tool call and ``close()`` ends it, with four small dependencies (no torch, no server). Its own
code-executing envs run the model's code on the trainer's host; here every ``<bash>`` block runs in an
aenv sandbox instead, created idempotently by rollout ID, kept alive and killed by ``aenv.rl.Episode``,
and an infrastructure failure ends the episode with ``metadata["infra_failed"]`` so the trainer can mask
it out rather than score it. ``verifiers`` 0.4 pulls ~30 packages (prime-sandboxes, mcp==2.0, a second
httpx) and wants its own sandbox client; ``openenv-core`` 0.3 pulls gradio, fastmcp, huggingface_hub and
openai (~60 packages) for an HTTP env server the sandbox would sit behind; NeMo Gym is not installable
from the index here. The GRPO-shaped loop (``examples/grpo_loop.py``) is the second integration.

The policy below is scripted (no model): it reads the task's numbers, then writes their sum.
"""

from __future__ import annotations

import re
import sys
import uuid
from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from aenv.rl import Episode, EpisodeNotStarted, is_infra

ENV_ID = "aenv-shell"
BASH = re.compile(r"<bash>(.*?)</bash>", re.S)
TASK = "Write the sum of the numbers in /tmp/task/numbers.txt to /tmp/task/answer.txt, then <submit/>."


class AenvShellEnv(BaseTextEnv):
    """``extras``: ``setup`` (a shell command that lays out the task), ``check`` (exit 0 = reward 1),
    ``template``, ``rollout_id``, ``run``; or ``episode``, an open ``aenv.rl.Episode`` to use (a fork
    child of ``run_group``), which the env then neither creates nor kills."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        extras = extras or {}
        self.max_turns = int(extras.get("max_turns", 4))
        self.setup, self.check = extras.get("setup"), extras["check"]
        self.episode: Episode | None = extras.get("episode")
        self._owned = self.episode is None
        self._opts = {"rollout_id": extras.get("rollout_id") or uuid.uuid4().hex, "run": extras.get("run"),
                      "timeout": int(extras.get("timeout", 60))}
        self._template = extras.get("template", "base")

    def init(self, prompt: list[dict[str, str]]) -> tuple[list[dict[str, str]], dict[str, Any]]:
        if self._owned:
            self.episode = Episode(self._template, **self._opts).__enter__()
        assert self.episode is not None
        if self.setup:
            self.episode.run(self.setup)
        return prompt, {"sandbox_id": self.episode.sandbox_id}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        assert self.episode is not None, "init() first"
        self.turns += 1
        meta: dict[str, Any] = {"turn": self.turns}
        try:
            observations = []
            for cmd in BASH.findall(action):
                r = self.episode.run(cmd)
                observations.append({"role": "user", "content": f"exit {r.exit_code}\n{r.stdout}{r.stderr}"})
            done = "<submit/>" in action or self.turns >= self.max_turns
            reward = float(self.episode.run(self.check).exit_code == 0) if done else 0.0
        except Exception as exc:
            if not is_infra(exc):  # the caller's bug: propagate
                raise
            self.episode.outcome.fail_infra(exc)
            return BaseTextEnvStepOutput(observations=[], reward=0.0, done=True, postprocessed_action=action,
                                         metadata={**meta, "infra_failed": self.episode.outcome.error})
        return BaseTextEnvStepOutput(observations=observations, reward=reward, done=done,
                                     postprocessed_action=action, metadata=meta)

    def close(self) -> None:
        if self._owned and self.episode is not None:
            self.episode.__exit__(None, None, None)
            self.episode = None

    def get_metrics(self) -> dict[str, Any]:
        return dict(self.episode.metrics) if self.episode is not None else {}


def register() -> None:
    import skyrl_gym

    if ENV_ID not in skyrl_gym.registry:
        skyrl_gym.register(id=ENV_ID, entry_point=f"{__name__}:AenvShellEnv")


def scripted_policy(observations: list[dict[str, str]]) -> str:
    """Turn 1 reads the task; turn 2 answers with the sum of what it read."""
    if not observations:
        return "<bash>cat /tmp/task/numbers.txt</bash>"
    numbers = [int(tok) for tok in observations[-1]["content"].split()[2:]]
    return f"<bash>echo {sum(numbers)} > /tmp/task/answer.txt</bash><submit/>"


def task(seed: int) -> dict[str, str]:
    numbers = " ".join(str((seed * 7 + i * 13) % 97) for i in range(5))
    return {"setup": f"mkdir -p /tmp/task && echo {numbers} > /tmp/task/numbers.txt",
            "check": "test \"$(cat /tmp/task/answer.txt)\" = "
                     "\"$(awk '{s=0; for (i=1;i<=NF;i++) s+=$i; print s}' /tmp/task/numbers.txt)\""}


def run_episode(seed: int, run: str) -> dict[str, Any]:
    """One multi-turn episode through ``skyrl_gym.make``, as a SkyRL trainer drives an env."""
    import skyrl_gym

    register()
    env = skyrl_gym.make(ENV_ID, env_config=None, extras={**task(seed), "run": run,
                                                           "rollout_id": f"{run}-{seed}"})
    total, turns, meta = 0.0, 0, {}
    try:
        obs, _ = env.init([{"role": "user", "content": TASK}])
        history: list[dict[str, str]] = []
        done = False
        while not done:
            out = env.step(scripted_policy(history))
            history += out["observations"]
            total, done, meta, turns = total + out["reward"], out["done"], out["metadata"], turns + 1
        metrics = env.get_metrics()
    except EpisodeNotStarted as exc:
        return {"seed": seed, "reward": 0.0, "turns": 0, "infra_failed": exc.outcome.error}
    finally:
        env.close()
    return {"seed": seed, "reward": total, "turns": turns, "infra_failed": meta.get("infra_failed"),
            "metrics": metrics}


def main(episodes: int = 4, run: str | None = None) -> list[dict[str, Any]]:
    run = run or f"skyrl-{uuid.uuid4().hex[:8]}"
    results = [run_episode(seed, run) for seed in range(episodes)]
    for r in results:
        print(f"episode {r['seed']}: reward {r['reward']} in {r['turns']} turns"
              + (f" (infra failure: {r['infra_failed']})" if r["infra_failed"] else ""))
    return results


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)

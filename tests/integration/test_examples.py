"""The examples of ``examples/`` in a short form against a real server (ns, and vm under
``AENV_TEST_RUNTIME=vm``): the SkyRL-Gym environment backed by aenv, and the GRPO-shaped loop."""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.integration.conftest import API_KEY, Server


def _listed(server: Server, run: str) -> list[str]:
    resp = httpx.get(server.url + "/v2/sandboxes", params={"metadata": f"run={run}"},
                     headers={"X-API-KEY": API_KEY}, trust_env=False)
    return [s["sandboxID"] for s in resp.json()]


def test_skyrl_gym_env_backed_by_aenv(server: Server, e2b_env: dict[str, str]) -> None:
    pytest.importorskip("skyrl_gym", reason="skyrl-gym is in the test extra: pip install -e '.[test]'")
    from examples import skyrl_gym_env

    run = f"skyrl-{uuid.uuid4().hex[:8]}"
    results = skyrl_gym_env.main(episodes=2, run=run)
    assert [r["reward"] for r in results] == [1.0, 1.0], results
    assert all(r["turns"] == 2 and not r["infra_failed"] for r in results)
    assert results[0]["metrics"]["commands"] >= 4  # setup, the two tool calls, the check
    assert _listed(server, run) == []  # every episode's sandbox was killed on close


def test_skyrl_env_marks_a_lost_sandbox_as_infrastructure(server: Server, e2b_env: dict[str, str]) -> None:
    pytest.importorskip("skyrl_gym", reason="skyrl-gym is in the test extra: pip install -e '.[test]'")
    import skyrl_gym

    from examples import skyrl_gym_env

    skyrl_gym_env.register()
    env = skyrl_gym.make(skyrl_gym_env.ENV_ID, extras={**skyrl_gym_env.task(3), "rollout_id": uuid.uuid4().hex})
    try:
        _, info = env.init([])
        httpx.delete(f"{server.url}/sandboxes/{info['sandbox_id']}", headers={"X-API-KEY": API_KEY},
                     trust_env=False)
        out = env.step("<bash>true</bash>")
    finally:
        env.close()
    assert out["done"] and out["reward"] == 0.0 and out["metadata"]["infra_failed"]


def test_grpo_loop_prompts_times_forks(server: Server, e2b_env: dict[str, str]) -> None:
    from examples import grpo_loop

    run = f"grpo-{uuid.uuid4().hex[:8]}"
    res = grpo_loop.grpo_step(2, 4, prepare_mb=1, run=run)
    assert res.rollouts == 8 and res.infra_failures == 0
    for p, g in enumerate(res.groups):
        expected = [grpo_loop.policy(p, i) == grpo_loop.answer(p) for i in range(4)]
        # the reward is computed from the state the fork carried over: exact guesses score 1
        assert [s == 1.0 for s in g.scores] == expected, g.scores
        assert len(g.kept) == 1 and g.fork_mode
    assert all(len(a) == 4 and abs(sum(x or 0.0 for x in a)) < 1e-3 for a in res.advantages)
    assert _listed(server, run) == []  # parents, the rest and (keep_best=False) the kept ones all gone

"""Chaos during a real workload (issue 39, item 5): the bench's ``chaos`` run, small — a GRPO-shaped run of
``aenv.rl`` groups (2 groups × 3 forked rollouts per fault) through a 3-node ``aenv cluster local`` while
Redis restarts during a create, the gateway is SIGKILLed and restarted during a fork, and a node's machine
loses power during rollouts.

Every rollout comes back: ok with the score its policy implies, or infra-failed with a reason; none is
lost (a group that hung or raised), none errs or scores wrong, and only the children of a fork whose
answer was cut off outlive their group. The faults land where they are meant to, and the node killed last is still fenced by Ray after Redis and the
gateway restarted. Slow (a cluster starts: ~30 s, the run ~40 s): marked ``cluster`` and ``slow``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def run() -> dict[str, Any]:
    from bench import chaos
    from bench.cluster import _missing
    from bench.context import Ctx

    if os.geteuid() != 0 or (why := _missing()) is not None:
        pytest.skip(why if os.geteuid() == 0 else "network namespaces and the ns runtime need root")
    return chaos.chaos(Ctx("ns", "", None, True, None))  # type: ignore[arg-type]


def test_no_rollout_is_lost_and_every_failure_says_why(run: dict[str, Any]) -> None:
    counts = run["chaos"]["counts"]
    assert counts["all"]["rollouts"] == 3 * 2 * 3
    assert (counts["all"]["lost"], counts["all"]["error"], counts["all"]["wrong"]) == (0, 0, 0), run["chaos"]["table"]
    for r in run["chaos"]["rollouts"]:
        assert r["status"] in ("ok", "command_failed", "infra_failed"), r
        if r["status"] == "infra_failed":
            assert r["reason"] and r["error"], r
    assert counts["all"]["ok"] + counts["all"]["infra_failed"] + counts["all"]["command_failed"] == 18


def test_only_children_of_a_cut_fork_outlive_their_group(run: dict[str, Any]) -> None:
    """A group kills every sandbox it knows of. The children of a fork whose answer the gateway's death cut
    off are unknown to it: they carry the parent's tag and end with their timeout or the lease; that
    group's rollouts all said ``fork: …``."""
    left = run["chaos"]["left_running"]
    assert left is not None, run["notes"]
    for tag in left:
        group = [r for r in run["chaos"]["rollouts"] if tag == f"{r['fault']}-g{r['group']}-parent"
                 or tag.endswith(f"-{r['fault']}-g{r['group']}-parent")]  # fmt: skip
        assert group and all(r["error"].startswith("fork: ") for r in group), (tag, group)


def test_each_fault_landed_at_its_point(run: dict[str, Any]) -> None:
    notes = {n.split(":", 1)[0]: n for n in run["notes"]}
    assert "group 1 creating its sandbox: Redis stopped" in notes["redis"]
    assert "group 1 forking: gateway SIGKILLed" in notes["gateway"]
    assert "group 1 rolling out: node n" in notes["node"] and "fenced after" in notes["node"]
    assert not any("missed" in n for n in run["notes"]), run["notes"]
    # the dead node's in-flight rollouts are infra failures that say so; the node was fenced although Redis
    # (Ray's GCS store) and the gateway had restarted before
    node = run["chaos"]["counts"]["node"]
    assert node["infra_failed"] > 0 and "fenced after 120.0 s" not in notes["node"]

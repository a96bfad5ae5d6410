"""``aenv.rl`` against a real server through the unmodified SDK: episodes (idempotent create, keepalive,
kill on exit, outcomes) and GRPO-shaped groups (prepare once, fork, score, keep the best)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
import pytest

from aenv.rl import COMMAND_FAILED, INFRA_FAILED, OK, AsyncEpisode, Episode, arun_group, run_group
from tests.integration.conftest import API_KEY, Server


def _listed(server: Server, **metadata: str) -> list[str]:
    q = "&".join(f"{k}={v}" for k, v in metadata.items())
    resp = httpx.get(server.url + "/v2/sandboxes", params={"metadata": q}, headers={"X-API-KEY": API_KEY},
                     trust_env=False)
    return [s["sandboxID"] for s in resp.json()]


def test_episode_outcomes_keepalive_and_kill(server: Server, e2b_env: dict[str, str]) -> None:
    run = f"rl-{uuid.uuid4().hex[:8]}"
    with Episode("base", rollout_id=f"{run}-0", run=run, timeout=5, keepalive=1) as ep:
        assert _listed(server, run=run, rollout=f"{run}-0") == [ep.sandbox_id]
        assert ep.run("echo hi").stdout == "hi\n" and ep.outcome.status == OK
        time.sleep(7)  # past its 5 s TTL: the keepalive holds it
        failed = ep.run("echo nope >&2; exit 3")
        assert failed.exit_code == 3
    assert ep.outcome.status == COMMAND_FAILED and ep.outcome.exit_code == 3 and "nope" in (ep.outcome.error or "")
    assert ep.metrics["keepalives"] >= 4 and ep.metrics["commands"] == 2 and ep.metrics["create_s"] > 0
    assert _listed(server, run=run) == []  # killed on exit


def test_episode_create_is_idempotent_by_rollout_id(server: Server, e2b_env: dict[str, str]) -> None:
    rid = f"rl-{uuid.uuid4().hex[:8]}"
    with Episode("base", rollout_id=rid, kill=False) as first, Episode("base", rollout_id=rid) as retry:
        assert retry.sandbox_id == first.sandbox_id
    assert _listed(server, rollout=rid) == []


def test_a_lost_sandbox_is_an_infra_failure(server: Server, e2b_env: dict[str, str]) -> None:
    with Episode("base", rollout_id=f"rl-{uuid.uuid4().hex[:8]}") as ep:
        httpx.delete(f"{server.url}/sandboxes/{ep.sandbox_id}", headers={"X-API-KEY": API_KEY}, trust_env=False)
        ep.run("echo never")
        pytest.fail("the command on a killed sandbox must raise")
    assert ep.outcome.status == INFRA_FAILED and ep.outcome.infra_failure and ep.outcome.error


def test_user_errors_propagate(server: Server, e2b_env: dict[str, str]) -> None:
    with pytest.raises(ZeroDivisionError), Episode("base", rollout_id=f"rl-{uuid.uuid4().hex[:8]}") as ep:
        1 / 0  # noqa: B018
    assert ep.outcome.status == "error" and _listed(server, rollout=ep.rollout_id) == []


def test_group_prepares_once_forks_and_keeps_the_best(server: Server, e2b_env: dict[str, str]) -> None:
    run = f"rl-{uuid.uuid4().hex[:8]}"

    def prepare(ep: Episode) -> None:
        ep.run("echo prepared > /tmp/task")

    def rollout(ep: Episode, i: int) -> float:
        assert ep.run("cat /tmp/task").stdout == "prepared\n"  # every child starts from the prepared state
        ep.run(f"exit {i % 2}")  # odd children's command fails: still scored
        return float(i)

    result = run_group("base", 4, rollout, prepare=prepare, keep=1, run=run, timeout=120)
    try:
        assert result.scores == [0.0, 1.0, 2.0, 3.0]
        assert [m.outcome.status for m in result.members] == [OK, COMMAND_FAILED, OK, COMMAND_FAILED]
        assert result.kept == [result.members[3].sandbox_id]
        assert _listed(server, run=run) == result.kept  # the parent and the other children are gone
        assert result.fork_mode in ("full", "filesystem") and result.metrics["fork_s"] > 0
    finally:
        httpx.post(server.url + "/aenv/sandboxes/kill", json={"metadata": {"run": run}},
                   headers={"X-API-KEY": API_KEY}, trust_env=False)


async def test_async_episode_and_group(server: Server, e2b_env: dict[str, str]) -> None:
    run = f"rl-{uuid.uuid4().hex[:8]}"
    async with AsyncEpisode("base", rollout_id=f"{run}-solo", run=run, timeout=4, keepalive=1) as ep:
        import asyncio

        await asyncio.sleep(5)
        assert (await ep.run("echo async")).stdout == "async\n"
    assert ep.outcome.ok and ep.metrics["keepalives"] >= 3

    async def rollout(child: AsyncEpisode, i: int) -> float:
        return float((await child.run("echo 7")).stdout.strip()) + i

    result = await arun_group("base", 2, rollout, run=run, keep=0, timeout=120)
    assert result.scores == [7.0, 8.0] and result.kept == []
    assert _listed(server, run=run) == []


TRAINER = """
import sys, time
from aenv.rl import Episode, Lease, run_group
run = sys.argv[1]
with Lease(ttl=3, name=run, end=False) as lease:
    with Episode("base", rollout_id=run + "-solo", run=run, timeout=600, kill=False, lease=lease) as ep:
        ep.run("true")
    group = run_group("base", 2, lambda ep, i: float(i), keep=2, run=run, timeout=600, lease=lease)
    print(lease.lease_id, ep.sandbox_id, *group.kept, flush=True)
    time.sleep(600)  # the test kills this trainer with SIGKILL: its heartbeat stops with it
"""


def test_a_killed_trainer_loses_its_sandboxes_to_the_lease(server: Server, e2b_env: dict[str, str]) -> None:
    """A trainer holding sandboxes with TTLs of 10 min dies (SIGKILL): one missed lease heartbeat ends
    them all, fork children included, and each says why."""
    import os
    import signal
    import subprocess
    import sys

    run = f"rl-{uuid.uuid4().hex[:8]}"
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, run], stdout=subprocess.PIPE, text=True,
                               env={**os.environ})
    try:
        assert trainer.stdout is not None
        lease_id, *sandboxes = trainer.stdout.readline().split()
        assert len(sandboxes) == 3 and set(_listed(server, run=run)) == set(sandboxes)
        time.sleep(4)  # past the 3 s ttl: the trainer's heartbeats hold them
        assert set(_listed(server, run=run)) == set(sandboxes)
        os.kill(trainer.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _listed(server, run=run) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _listed(server, run=run) == []
        for sid in sandboxes:
            resp = httpx.get(f"{server.url}/sandboxes/{sid}", headers={"X-API-KEY": API_KEY, "Prefer": "aenv-gone=410"},
                             trust_env=False)
            assert resp.status_code == 410 and resp.json()["reason"] == "lease_expired", resp.text
        lease = httpx.get(f"{server.url}/aenv/leases/{lease_id}", headers={"X-API-KEY": API_KEY}, trust_env=False)
        assert lease.json()["state"] == "ended" and lease.json()["endReason"] == "expired"
    finally:
        trainer.kill()
        trainer.wait()
        if trainer.stdout is not None:
            trainer.stdout.close()
        httpx.post(server.url + "/aenv/sandboxes/kill", json={"metadata": {"run": run}},
                   headers={"X-API-KEY": API_KEY}, trust_env=False)


def test_tree_expand_score_prune_checkpoint_rollback(server: Server, e2b_env: dict[str, str]) -> None:
    from e2b import Sandbox

    from aenv.rl import SearchTree, beam_search

    root = Sandbox.create("base", timeout=300)
    root.commands.run("echo 0 > /tmp/path")
    with SearchTree(root.sandbox_id, timeout=300) as tree:
        kids = tree.expand(tree.root, 3)
        assert len(kids) == 3 and all(k.depth == 1 and k.parent is tree.root for k in kids)

        def act(ep: Episode, node: Any) -> float:  # each branch appends its own step
            i = kids.index(node)
            ep.run(f"echo {i} >> /tmp/path")
            return float(i)

        tree.score(kids, act)
        best = tree.keep_best(kids, 1)
        assert [n.score for n in best] == [2.0] and [k.alive for k in kids] == [False, False, True]
        assert _listed_ids(server) >= {root.sandbox_id, kids[2].sandbox_id}
        assert not {kids[0].sandbox_id, kids[1].sandbox_id} & _listed_ids(server)
        node = best[0]
        tree.checkpoint(node)
        with tree.episode(node) as ep:
            assert ep.run("cat /tmp/path").stdout.split() == ["0", "2"]
            ep.run("echo wrong-turn >> /tmp/path")
        tree.rollback(node)  # back to the checkpoint, same sandbox ID
        with tree.episode(node) as ep:
            assert ep.run("cat /tmp/path").stdout.split() == ["0", "2"]
    assert not {root.sandbox_id, kids[2].sandbox_id} & _listed_ids(server)  # every live node ended on exit

    def step(ep: Episode, node: Any) -> float:
        return float(ep.run("od -An -N2 -tu2 /dev/urandom").stdout.strip())

    leaf, tree = beam_search("base", step, width=2, branch=2, depth=2, timeout=300,
                             prepare=lambda ep: ep.run("echo prepared > /tmp/p"))
    try:
        assert leaf.depth == 2 and leaf.alive and [n.alive for n in tree.nodes].count(True) == 1
        with tree.episode(leaf) as ep:
            assert ep.run("cat /tmp/p").stdout == "prepared\n"
    finally:
        tree.prune([leaf])


def _listed_ids(server: Server) -> set[str]:
    resp = httpx.get(server.url + "/v2/sandboxes", headers={"X-API-KEY": API_KEY}, trust_env=False)
    return {s["sandboxID"] for s in resp.json()}


def test_group_rolls_the_rest_back_to_the_prepared_state(server: Server, e2b_env: dict[str, str]) -> None:
    from e2b import Sandbox

    run = f"rl-{uuid.uuid4().hex[:8]}"

    def rollout(ep: Episode, i: int) -> float:
        ep.run(f"echo tried-{i} >> /tmp/task")
        return float(i)

    result = run_group("base", 3, rollout, prepare=lambda ep: ep.run("echo prepared > /tmp/task"), keep=1,
                       run=run, timeout=120, rest="rollback")
    try:
        assert result.kept == [result.members[2].sandbox_id] and result.snapshot_id
        assert sorted(result.recycled) == sorted(m.sandbox_id for m in result.members[:2] if m.sandbox_id)
        assert set(_listed(server, run=run)) == {*result.kept, *result.recycled}
        for sid in result.recycled:  # back to the prepared state, ready for the next group
            assert Sandbox.connect(sid).commands.run("cat /tmp/task").stdout == "prepared\n"
        assert Sandbox.connect(result.kept[0]).commands.run("cat /tmp/task").stdout == "prepared\ntried-2\n"
    finally:
        httpx.post(server.url + "/aenv/sandboxes/kill", json={"metadata": {"run": run}},
                   headers={"X-API-KEY": API_KEY}, trust_env=False)

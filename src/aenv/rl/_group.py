"""GRPO-shaped groups: prepare one sandbox, fork it n ways, roll out each child, keep the best k.

Preparing (installing a task, checking out a repo, warming a model server) is done once; aenv's fork
(``POST /sandboxes/{id}/fork``, through ``aenv.client``) copies the prepared sandbox into n children
with new IDs, so every rollout of the group starts from the same state at the cost of one fork.
The parent ends after the fork; children whose rollout failed on the infrastructure side get no
score; the best ``keep`` children by score stay running (to branch again, or to inspect) and the
rest are killed. A group never raises for the infrastructure: when the parent's create, its
preparation's commands or the fork call fail on that side, every member comes back infra-failed with
the stage and the reason (``create: …``, ``prepare: …``, ``fork: …``), and ``metrics["failed_at"]`` names
the stage.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aenv.rl._connection import client as _client
from aenv.rl._episode import AsyncEpisode, Episode
from aenv.rl._kill import akill_until, kill_until
from aenv.rl._kill import deadline as kill_deadline
from aenv.rl._lease import Lease
from aenv.rl._outcome import INFRA_FAILED, Outcome, is_infra


@dataclass
class Member:
    index: int
    sandbox_id: str | None
    score: float | None
    outcome: Outcome


@dataclass
class GroupResult:
    members: list[Member]
    kept: list[str]  # sandbox IDs left running: the best ``keep`` by score
    fork_mode: str | None  # "full" (memory too) or "filesystem"
    metrics: dict[str, Any] = field(default_factory=dict)
    # rest="rollback": the other children, rolled back to the prepared state (the fork's snapshot),
    # ready for the next group without a new create or preparation
    recycled: list[str] = field(default_factory=list)
    snapshot_id: str | None = None  # the prepared state the children were forked from

    @property
    def scores(self) -> list[float | None]:
        return [m.score for m in self.members]


def _fork(parent_id: str, n: int, timeout: int, connection: dict[str, Any]) -> tuple[list[str], list[str], str | None, str | None]:
    with _client(connection) as c:
        result = c.fork(parent_id, n, timeout=timeout)
    return result.sandbox_ids, result.errors, result.mode, result.snapshot_id


def _recycle(doomed: list[str], snapshot_id: str | None, connection: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(rolled back to the prepared snapshot, could not be: to kill)."""
    if snapshot_id is None:
        return [], doomed
    back, failed = [], []
    with _client(connection) as c:
        for sid in doomed:
            try:
                c.rollback(sid, snapshot_id)
                back.append(sid)
            except Exception:  # noqa: BLE001 - a child that cannot go back is killed instead
                failed.append(sid)
    return back, failed


def _rank(members: list[Member], keep: int) -> tuple[list[str], list[str]]:
    """(kept, to kill): the best ``keep`` scored members stay, every other started one goes."""
    scored = sorted((m for m in members if m.score is not None and m.outcome.status != INFRA_FAILED
                     and m.sandbox_id), key=lambda m: m.score or 0.0, reverse=True)
    kept = [m.sandbox_id for m in scored[:keep] if m.sandbox_id]
    return kept, [m.sandbox_id for m in members if m.sandbox_id and m.sandbox_id not in kept]


def _infra_member(i: int, why: str) -> Member:
    outcome = Outcome()
    outcome.status, outcome.error = INFRA_FAILED, why
    return Member(i, None, None, outcome)


def _failed_forks(errors: list[str], first: int) -> list[Member]:
    return [_infra_member(i, f"fork: {why}") for i, why in enumerate(errors, start=first)]


def _unstarted(n: int, stage: str, exc: BaseException, metrics: dict[str, Any], t0: float) -> GroupResult:
    """The group whose parent failed on the infrastructure side (its create, its preparation's commands, the
    fork call): no rollout ran, and each of the ``n`` says why, as a rollout that failed would. A trainer
    gets its group back with every member masked, not an exception that loses the group's accounting."""
    metrics.update(failed_at=stage, total_s=round(time.monotonic() - t0, 4))
    why = f"{stage}: {type(exc).__name__}: {exc}"
    return GroupResult([_infra_member(i, why) for i in range(n)], [], None, metrics)


def run_group(template: str, n: int, rollout: Callable[[Episode, int], float], *,
              prepare: Callable[[Episode], None] | None = None, keep: int = 0, run: str | None = None,
              group_id: str | None = None, timeout: int = 300, lease: Lease | None = None,
              rest: str = "kill", **connection: Any) -> GroupResult:
    """Prepare once, fork ``n`` ways, ``rollout(episode, i) -> score`` in threads, keep the best ``keep``;
    the rest are killed, or with ``rest="rollback"`` rolled back to the prepared state (``recycled``).
    With ``lease``, the parent and (by inheritance) every child are bound to it."""
    _check_rest(rest)
    gid = group_id or uuid.uuid4().hex[:12]
    metrics: dict[str, Any] = {}
    t0 = time.monotonic()
    stage = "create"
    try:
        with Episode(template, rollout_id=f"{gid}-parent", run=run, timeout=timeout, suppress_infra=False,
                     lease=lease, **connection) as parent:
            stage = "prepare"
            if prepare is not None:
                prepare(parent)
            metrics["prepare_s"] = round(time.monotonic() - t0, 4)
            stage, t1 = "fork", time.monotonic()
            ids, errors, mode, snapshot_id = _fork(parent.sandbox.sandbox_id, n, timeout, connection)
            metrics["fork_s"] = round(time.monotonic() - t1, 4)
    except Exception as exc:
        if not is_infra(exc):
            raise  # the caller's own code (prepare) raised: a bug, not an outcome
        return _unstarted(n, stage, exc, metrics, t0)

    def one(i: int, sandbox_id: str) -> Member:
        ep = Episode(template, rollout_id=f"{gid}-{i}", run=run, timeout=timeout, sandbox_id=sandbox_id,
                     kill=False, **connection)
        try:
            with ep:
                ep.score = rollout(ep, i)
        except Exception:  # noqa: BLE001 - the caller's bug ends this member, not the group
            pass
        return Member(i, sandbox_id, ep.score if ep.outcome.status != INFRA_FAILED else None, ep.outcome)

    with ThreadPoolExecutor(max(1, len(ids))) as pool:
        members = list(pool.map(one, range(len(ids)), ids))
    members += _failed_forks(errors, len(ids))
    kept, doomed = _rank(members, keep)
    recycled, doomed = _recycle(doomed, snapshot_id, connection) if rest == "rollback" else ([], doomed)
    from e2b import Sandbox

    until = kill_deadline()
    _kill_errors(metrics, {sid: kill_until(functools.partial(Sandbox.kill, sid, **connection), until) for sid in doomed})
    metrics["total_s"] = round(time.monotonic() - t0, 4)
    return GroupResult(members, kept, mode, metrics, recycled, snapshot_id)


async def arun_group(template: str, n: int, rollout: Callable[[AsyncEpisode, int], Awaitable[float]], *,
                     prepare: Callable[[AsyncEpisode], Awaitable[None]] | None = None, keep: int = 0,
                     run: str | None = None, group_id: str | None = None, timeout: int = 300,
                     lease: Lease | None = None, rest: str = "kill", **connection: Any) -> GroupResult:
    """``run_group`` over the async SDK: the rollouts run concurrently on the event loop."""
    _check_rest(rest)
    gid = group_id or uuid.uuid4().hex[:12]
    metrics: dict[str, Any] = {}
    t0 = time.monotonic()
    stage = "create"
    try:
        async with AsyncEpisode(template, rollout_id=f"{gid}-parent", run=run, timeout=timeout,
                                suppress_infra=False, lease=lease, **connection) as parent:
            stage = "prepare"
            if prepare is not None:
                await prepare(parent)
            metrics["prepare_s"] = round(time.monotonic() - t0, 4)
            stage, t1 = "fork", time.monotonic()
            ids, errors, mode, snapshot_id = await asyncio.to_thread(_fork, parent.sandbox.sandbox_id, n, timeout,
                                                                     connection)  # fmt: skip
            metrics["fork_s"] = round(time.monotonic() - t1, 4)
    except Exception as exc:
        if not is_infra(exc):
            raise
        return _unstarted(n, stage, exc, metrics, t0)

    async def one(i: int, sandbox_id: str) -> Member:
        ep = AsyncEpisode(template, rollout_id=f"{gid}-{i}", run=run, timeout=timeout, sandbox_id=sandbox_id,
                          kill=False, **connection)
        try:
            async with ep:
                ep.score = await rollout(ep, i)
        except Exception:  # noqa: BLE001 - the caller's bug ends this member, not the group
            pass
        return Member(i, sandbox_id, ep.score if ep.outcome.status != INFRA_FAILED else None, ep.outcome)

    members = list(await asyncio.gather(*(one(i, sid) for i, sid in enumerate(ids))))
    members += _failed_forks(errors, len(ids))
    kept, doomed = _rank(members, keep)
    recycled: list[str] = []
    if rest == "rollback":
        recycled, doomed = await asyncio.to_thread(_recycle, doomed, snapshot_id, connection)
    from e2b import AsyncSandbox

    until = kill_deadline()
    _kill_errors(metrics, {sid: await akill_until(functools.partial(AsyncSandbox.kill, sid, **connection), until)
                           for sid in doomed})  # fmt: skip
    metrics["total_s"] = round(time.monotonic() - t0, 4)
    return GroupResult(members, kept, mode, metrics, recycled, snapshot_id)


def _kill_errors(metrics: dict[str, Any], errors: dict[str, str | None]) -> None:
    """Sandboxes the group could not kill (they end with their timeout or lease), in its metrics."""
    if failed := {sid: why for sid, why in errors.items() if why is not None}:
        metrics["kill_errors"] = failed


def _check_rest(rest: str) -> None:
    if rest not in ("kill", "rollback"):
        raise ValueError(f"rest: 'kill' or 'rollback', not {rest!r}")

"""The orchestrator as the one front door, on a fake runtime: every action in every lifecycle state,
template deletes draining the runtime's pools, and the reaper driven by an explicit clock."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from aenv.core.models import CreateRequest, ListQuery, SandboxState
from aenv.core.orchestrator import Orchestrator
from aenv.errors import AenvError, Conflict, InvalidRequest, SandboxNotFound, StateError
from aenv.kinds import SnapshotMode
from aenv.store.sqlite import now
from tests.fixtures.runtime import FakeRuntime


def fake(o: Orchestrator) -> FakeRuntime:
    assert isinstance(o.runtime, FakeRuntime)
    return o.runtime


async def _in_state(o: Orchestrator, state: str) -> str:
    """A sandbox in ``state``: running, paused, stopped (paused keeping its files only), or killed (gone)."""
    sid = (await o.create(CreateRequest(template="base"))).id
    if state == "paused":
        await o.pause(sid)
    elif state == "stopped":
        await o.pause(sid, keep_memory=False)
    elif state == "killed":
        await o.kill(sid)
    return sid


Action = Callable[[Orchestrator, str], Awaitable[Any]]


async def _rollback(o: Orchestrator, sid: str) -> Any:
    snap = o.list_snapshots()[0].id if o.list_snapshots() else "missing"
    return await o.rollback(sid, snap)


ACTIONS: dict[str, Action] = {
    "pause": lambda o, sid: o.pause(sid),
    "pause_files": lambda o, sid: o.pause(sid, keep_memory=False),
    "connect": lambda o, sid: o.connect(sid, 60),
    "connect_cold": lambda o, sid: o.connect(sid, 60, keep_memory=False),
    "kill": lambda o, sid: o.kill(sid),
    "set_timeout": lambda o, sid: o.set_timeout(sid, 60),
    "expire_now": lambda o, sid: o.set_timeout(sid, 0),
    "snapshot": lambda o, sid: o.snapshot(sid, None, "full"),
    "fork": lambda o, sid: o.fork(sid, 2, None),
    "rollback": _rollback,
}

# state × action → the state the sandbox ends in, or the error the action raises
TABLE: dict[tuple[str, str], str | type[AenvError]] = {
    ("running", "pause"): "paused",
    ("running", "pause_files"): "stopped",
    ("running", "connect"): "running",
    ("running", "connect_cold"): "running",  # nothing to resume: it just runs on
    ("running", "kill"): "gone",
    ("running", "set_timeout"): "running",
    ("running", "expire_now"): "gone",  # no autoPause: expiry kills
    ("running", "snapshot"): "running",
    ("running", "fork"): "running",
    ("running", "rollback"): "running",
    ("paused", "pause"): StateError,
    ("paused", "pause_files"): StateError,
    ("paused", "connect"): "running",  # E2B connect resumes a paused sandbox
    ("paused", "connect_cold"): "running",  # its memory discarded: a cold start
    ("paused", "kill"): "gone",
    ("paused", "set_timeout"): StateError,
    ("paused", "expire_now"): StateError,
    ("paused", "snapshot"): "paused",
    ("paused", "fork"): StateError,
    ("paused", "rollback"): "running",
    ("stopped", "pause"): StateError,
    ("stopped", "pause_files"): StateError,
    ("stopped", "connect"): "running",  # a cold start on its files
    ("stopped", "connect_cold"): "running",
    ("stopped", "kill"): "gone",
    ("stopped", "set_timeout"): StateError,
    ("stopped", "expire_now"): StateError,
    ("stopped", "snapshot"): StateError,  # no processes to capture: resume it first
    ("stopped", "fork"): StateError,
    ("stopped", "rollback"): StateError,
    **{("killed", a): SandboxNotFound for a in ACTIONS},
}
# what the runtime was asked for, per action that reached it (the rest: nothing new)
RUNTIME_CALL = {("running", "pause_files"): "stop", ("paused", "connect"): "resume",
                ("paused", "connect_cold"): "boot", ("stopped", "connect"): "boot", ("stopped", "connect_cold"): "boot"}


@pytest.mark.parametrize(("state", "action"), sorted(TABLE), ids=lambda v: str(v))
async def test_every_action_in_every_state(orch: Orchestrator, state: str, action: str) -> None:
    sid = await _in_state(orch, state)
    if action == "rollback" and state != "killed":
        # a snapshot in the sandbox's lineage to roll back to (taken while running)
        if state != "running":
            await orch.connect(sid, 60)
        await orch.snapshot(sid, None, "full")
        if state != "running":
            await orch.pause(sid, keep_memory=state == "paused")
    expected = TABLE[(state, action)]
    calls_before = list(fake(orch).calls)
    if isinstance(expected, type):
        with pytest.raises(expected):
            await ACTIONS[action](orch, sid)
        # a refused action changed nothing: same state, and the runtime was never asked
        assert fake(orch).calls == calls_before
        if state != "killed":
            assert _seen_state(orch, sid) == state
        return
    await ACTIONS[action](orch, sid)
    if (state, action) in RUNTIME_CALL:
        assert fake(orch).calls[len(calls_before):] == [(RUNTIME_CALL[(state, action)], sid)]
    if expected == "gone":
        with pytest.raises(SandboxNotFound):
            orch.get(sid)
        assert sid not in orch.table and orch.store.get_sandbox(sid) is None
    else:
        assert _seen_state(orch, sid) == expected
        row = orch.store.get_sandbox(sid)
        assert row is not None and (row.state, row.pause_mode) == (orch.get(sid).row.state, orch.get(sid).row.pause_mode)


def _seen_state(o: Orchestrator, sid: str) -> str:
    """running, paused, or stopped (paused keeping only files), from the row (as clients see it)."""
    row = o.get(sid).row
    if row.state is SandboxState.PAUSED and row.pause_mode is SnapshotMode.FILESYSTEM:
        return "stopped"
    return row.state.value


async def test_a_pause_under_way_shows_running_and_a_connect_waits_for_it(orch: Orchestrator) -> None:
    """E2B clients never see a sandbox vanish mid-pause (the reaper's pause at expiry is polled with
    get_info), and a connect meanwhile waits for the pause, then resumes (spec: 'in a transition, wait')."""
    sid = await _in_state(orch, "running")
    fake(orch).pause_gate = gate = asyncio.Event()
    pausing = asyncio.create_task(orch.pause(sid))
    await asyncio.sleep(0.01)
    sbx = orch.get(sid)
    assert sbx.state is SandboxState.PAUSING and sbx.state.shown is SandboxState.RUNNING
    listed, _ = orch.list_sandboxes(ListQuery(states=frozenset({SandboxState.RUNNING})))
    assert [s.id for s in listed] == [sid]
    connecting = asyncio.create_task(orch.connect(sid, 60))
    await asyncio.sleep(0.01)
    assert not connecting.done()
    gate.set()
    await pausing
    _, resumed = await connecting
    assert resumed and orch.get(sid).state is SandboxState.RUNNING
    assert [c for c, i in fake(orch).calls if i == sid][-2:] == ["pause", "resume"]


async def test_fork_children_are_new_sandboxes_on_the_fork_point(orch: Orchestrator) -> None:
    sid = await _in_state(orch, "running")
    kids = await orch.fork(sid, 3, None)
    assert all(not isinstance(k, AenvError) for k in kids)
    ids = [k.id for k in kids if not isinstance(k, AenvError)]
    assert len(set(ids)) == 3 and sid not in ids
    point = orch.get(sid).row.lineage_head
    assert point is not None and all(orch.get(i).row.lineage_head == point for i in ids)
    assert orch.find_snapshot(point) is not None and orch.find_snapshot(point).internal  # type: ignore[union-attr]
    # the fork point is an internal snapshot: collected once nothing descends from it
    for i in [*ids, sid]:
        await orch.kill(i)
    assert orch.find_snapshot(point) is None


async def test_fork_refuses_a_count_out_of_range(orch: Orchestrator) -> None:
    sid = await _in_state(orch, "running")
    for count in (0, 65):
        with pytest.raises(InvalidRequest):
            await orch.fork(sid, count, None)


async def test_deleting_a_template_drains_the_runtime_pools_unless_in_use(orch: Orchestrator, tmp_path: Path) -> None:
    (tmp_path / "other").mkdir()
    orch.templates.register(alias="other", kind="image", rootfs=tmp_path / "other", template_id="other")
    sid = (await orch.create(CreateRequest(template="other"))).id
    with pytest.raises(Conflict):
        await orch.delete_template("other")
    assert ("forget_template", "other") not in fake(orch).calls
    await orch.kill(sid)
    await orch.delete_template("other")
    assert ("forget_template", "other") in fake(orch).calls
    assert all(t.id != "other" for t in orch.list_templates())


async def test_deleting_a_snapshot_template_deletes_the_snapshot(orch: Orchestrator) -> None:
    sid = await _in_state(orch, "running")
    snap = await orch.snapshot(sid, "named", "full")
    await orch.kill(sid)
    await orch.delete_template("named")
    assert orch.find_snapshot(snap.id) is None
    assert not any(c == ("forget_template", snap.id) for c in fake(orch).calls)


async def test_reaper_kills_or_pauses_what_expired_at_the_given_time(orch: Orchestrator) -> None:
    keep = (await orch.create(CreateRequest(template="base", timeout=600))).id
    expire = (await orch.create(CreateRequest(template="base", timeout=60))).id
    pause = (await orch.create(CreateRequest(template="base", timeout=60, auto_pause=True))).id
    assert await orch.reap_expired(now()) == []  # nothing is due yet
    reaped = await orch.reap_expired(now() + 120)
    assert sorted(reaped) == sorted([expire, pause])
    with pytest.raises(SandboxNotFound):
        orch.get(expire)
    assert orch.get(pause).state is SandboxState.PAUSED
    assert orch.get(keep).state is SandboxState.RUNNING
    assert await orch.reap_expired(now() + 120) == []  # paused sandboxes are not reaped again


async def test_reaper_pauses_files_only_when_auto_pause_memory_is_off(orch: Orchestrator) -> None:
    sid = (await orch.create(CreateRequest(template="base", timeout=60, auto_pause=True, auto_pause_memory=False))).id
    assert await orch.reap_expired(now() + 120) == [sid]
    assert _seen_state(orch, sid) == "stopped" and ("stop", sid) in fake(orch).calls


async def test_a_failed_cold_resume_leaves_it_paused_files_only(orch: Orchestrator) -> None:
    """Once a resume has begun discarding memory, the sandbox never goes back to claiming it has some."""
    sid = await _in_state(orch, "paused")
    fake(orch).fail_resume = True
    with pytest.raises(AenvError):
        await orch.connect(sid, 60, keep_memory=False)
    assert _seen_state(orch, sid) == "stopped"
    assert orch.store.get_sandbox(sid).pause_mode is SnapshotMode.FILESYSTEM  # type: ignore[union-attr]
    fake(orch).fail_resume = False
    await orch.connect(sid, 60)  # and it comes back, cold
    assert fake(orch).calls[-1] == ("boot", sid)


@pytest.mark.parametrize(
    ("row_state", "mode", "expect"),
    [
        ("pausing", SnapshotMode.FILESYSTEM, "stopped"),  # died in the middle of a files-only pause
        ("paused", SnapshotMode.FILESYSTEM, "stopped"),
        ("resuming", SnapshotMode.FILESYSTEM, "stopped"),  # died during a cold start
        ("resuming", SnapshotMode.FULL, "paused"),
        ("pausing", SnapshotMode.FULL, "paused"),
    ],
)
async def test_recovery_settles_pauses_by_what_the_store_says_they_keep(
    orch: Orchestrator, row_state: str, mode: SnapshotMode, expect: str
) -> None:
    sid = await _in_state(orch, "running")
    orch.store.update_sandbox(sid, state=row_state, pause_mode=mode)  # as a kill -9 would leave it
    await orch.close()
    again = Orchestrator(orch.settings, orch.store, orch.runtime, orch.templates)
    await again.start()
    try:
        assert _seen_state(again, sid) == expect
        assert fake(again).sandboxes[sid] == expect  # the runtime was settled the same way
        row = again.store.get_sandbox(sid)
        assert row is not None and row.state is SandboxState.PAUSED and row.pause_mode is mode
        await again.connect(sid, 60)
        assert fake(again).calls[-1] == ("boot" if expect == "stopped" else "resume", sid)
    finally:
        await again.close()

"""The orchestrator as the one front door, on a fake runtime: every action in every lifecycle state,
template deletes draining the runtime's pools, and the reaper driven by an explicit clock."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from aenv.config import Settings
from aenv.core.models import CreateRequest, SandboxState
from aenv.core.orchestrator import Orchestrator
from aenv.core.templates import TemplateCatalog
from aenv.errors import AenvError, Conflict, InvalidRequest, SandboxNotFound, StateError
from aenv.store.sqlite import Store, now
from tests.fixtures.runtime import FakeRuntime


@pytest.fixture
async def orch(tmp_path: Path) -> AsyncIterator[Orchestrator]:
    settings = Settings(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache", reaper_interval=3600,
                        max_timeout=3600, snapshot_store="")
    settings.state_dir.mkdir(parents=True)
    (tmp_path / "rootfs").mkdir()
    store = Store(settings.db_path)
    catalog = TemplateCatalog(settings, store)
    catalog.register(alias="base", kind="bootstrap", rootfs=tmp_path / "rootfs", template_id="base")
    o = Orchestrator(settings, store, FakeRuntime(), catalog)
    await o.start()
    try:
        yield o
    finally:
        await o.close()
        store.close()


def fake(o: Orchestrator) -> FakeRuntime:
    assert isinstance(o.runtime, FakeRuntime)
    return o.runtime


async def _in_state(o: Orchestrator, state: str) -> str:
    """A sandbox in ``state``: running, paused, or killed (gone)."""
    sid = (await o.create(CreateRequest(template="base"))).id
    if state == "paused":
        await o.pause(sid)
    elif state == "killed":
        await o.kill(sid)
    return sid


Action = Callable[[Orchestrator, str], Awaitable[Any]]


async def _rollback(o: Orchestrator, sid: str) -> Any:
    snap = o.list_snapshots()[0].id if o.list_snapshots() else "missing"
    return await o.rollback(sid, snap)


ACTIONS: dict[str, Action] = {
    "pause": lambda o, sid: o.pause(sid),
    "connect": lambda o, sid: o.connect(sid, 60),
    "kill": lambda o, sid: o.kill(sid),
    "set_timeout": lambda o, sid: o.set_timeout(sid, 60),
    "snapshot": lambda o, sid: o.snapshot(sid, None, "full"),
    "fork": lambda o, sid: o.fork(sid, 2, None),
    "rollback": _rollback,
}

# state × action → the state the sandbox ends in, or the error the action raises
TABLE: dict[tuple[str, str], str | type[AenvError]] = {
    ("running", "pause"): "paused",
    ("running", "connect"): "running",
    ("running", "kill"): "gone",
    ("running", "set_timeout"): "running",
    ("running", "snapshot"): "running",
    ("running", "fork"): "running",
    ("running", "rollback"): "running",
    ("paused", "pause"): StateError,
    ("paused", "connect"): "running",  # E2B connect resumes a paused sandbox
    ("paused", "kill"): "gone",
    ("paused", "set_timeout"): StateError,
    ("paused", "snapshot"): "paused",
    ("paused", "fork"): StateError,
    ("paused", "rollback"): "running",
    **{("killed", a): SandboxNotFound for a in ACTIONS},
}


@pytest.mark.parametrize(("state", "action"), sorted(TABLE), ids=lambda v: str(v))
async def test_every_action_in_every_state(orch: Orchestrator, state: str, action: str) -> None:
    sid = await _in_state(orch, state)
    if action == "rollback" and state != "killed":
        # a snapshot in the sandbox's lineage to roll back to (taken while running)
        if state == "paused":
            await orch.connect(sid, 60)
        await orch.snapshot(sid, None, "full")
        if state == "paused":
            await orch.pause(sid)
    expected = TABLE[(state, action)]
    calls_before = list(fake(orch).calls)
    if isinstance(expected, type):
        with pytest.raises(expected):
            await ACTIONS[action](orch, sid)
        # a refused action changed nothing: same state, and the runtime was never asked
        assert fake(orch).calls == calls_before
        if state != "killed":
            assert orch.get(sid).state.value == state
        return
    await ACTIONS[action](orch, sid)
    if expected == "gone":
        with pytest.raises(SandboxNotFound):
            orch.get(sid)
        assert sid not in orch.table and orch.store.get_sandbox(sid) is None
    else:
        assert orch.get(sid).state is SandboxState(expected)
        assert orch.store.get_sandbox(sid).state == expected  # type: ignore[union-attr]


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

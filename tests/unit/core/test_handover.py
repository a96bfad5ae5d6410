"""Published pauses, the node's side without a cluster: what a pause carries to the adopting node, and
which lifecycle events publish or withdraw it."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from aenv.core.handover import CARRIED, PauseHandover, carried
from aenv.directory.node import PublishedPause
from aenv.errors import MachineMismatch
from aenv.kinds import SandboxState, SnapshotMode
from aenv.store.sqlite import SandboxRow


class Directory:
    def __init__(self) -> None:
        self.withdrawn: list[str] = []

    def unpublish_pause(self, sandbox_id: str) -> None:
        self.withdrawn.append(sandbox_id)


def _row(**kw: Any) -> SandboxRow:
    base: dict[str, Any] = dict(id="sbx1", template_id="base", state=SandboxState.PAUSED, runtime="ns", started_at=1.0,
                                end_at=2.0, cpu_count=2, memory_mb=512, disk_mb=1024)  # fmt: skip
    return SandboxRow(**{**base, **kw})


def _handover(directory: Directory) -> PauseHandover:
    orch = SimpleNamespace(runtime=SimpleNamespace(name="ns"), table=SimpleNamespace(next_seq=lambda: 7))
    return PauseHandover(orch, directory)  # type: ignore[arg-type]


def test_the_adopted_row_keeps_the_id_tokens_and_settings() -> None:
    row = _row(access_token="envd-tok", traffic_token="traffic-tok", metadata={"run": "r1"}, env_vars={"A": "1"},
               auto_pause=True, network={"allowOut": ["1.1.1.1"]}, alias="base", has_network=True)  # fmt: skip
    blob = json.loads(json.dumps(carried(row)))  # it travels as JSON in the binding
    assert set(blob) == set(CARRIED)
    pause = PublishedPause("sbx1", "n1", "gone", "snap1", blob, "")
    new = _handover(Directory())._row(pause, "snap1", 300, "snap1")
    assert (new.id, new.template_id, new.state, new.created_seq) == ("sbx1", "snap1", SandboxState.STARTING, 7)
    assert new.end_at - new.started_at == 300 and new.lineage_head == "snap1" and new.depends_on == ["snap1"]
    for name in CARRIED:
        assert getattr(new, name) == getattr(row, name), name


async def test_a_resume_withdraws_and_a_files_only_pause_publishes_nothing() -> None:
    directory = Directory()
    h = _handover(directory)
    h.on_event("paused", _row(pause_mode=SnapshotMode.FILESYSTEM, paused_at=1.0), {})
    h.on_event("created", _row(state=SandboxState.RUNNING), {})
    assert h._tasks == {} and directory.withdrawn == []
    h.on_event("resumed", _row(state=SandboxState.RUNNING), {})
    assert directory.withdrawn == ["sbx1"]


async def test_a_pause_of_a_sandbox_with_volumes_is_published_with_them_and_a_vm_one_is_not() -> None:
    """Its volumes' data travels with its pause (``_publish_volumes``); a vm sandbox's pause stays home."""
    h = _handover(Directory())
    h.on_event("paused", _row(pause_mode=SnapshotMode.FULL, paused_at=1.0, volume_mounts=[{"name": "v", "path": "/d"}]), {})
    assert list(h._tasks) == ["sbx1"]
    h._tasks.pop("sbx1").cancel()
    h.on_event("paused", _row(pause_mode=SnapshotMode.FULL, paused_at=1.0, runtime="vm"), {})
    assert h._tasks == {}  # nor is a vm sandbox's: its disk is layered on this node's template build
    h.on_event("paused", _row(pause_mode=SnapshotMode.FULL, paused_at=1.0), {})
    assert list(h._tasks) == ["sbx1"]
    h._tasks["sbx1"].cancel()


class Published(Directory):
    def __init__(self) -> None:
        super().__init__()
        self.published: list[tuple[str, str, dict[str, Any]]] = []

    def publish_pause(self, sandbox_id: str, snapshot_id: str, row: dict[str, Any]) -> bool:
        self.published.append((sandbox_id, snapshot_id, row))
        return True


def _orch(sbx: Any, upload: Any) -> Any:
    import asyncio

    class Table:
        def get(self, sandbox_id: str) -> Any:
            return sbx

        def __contains__(self, sandbox_id: str) -> bool:
            return sandbox_id == sbx.id

    async def fork_mode(sandbox_id: str) -> SnapshotMode:
        return SnapshotMode.FULL

    async def snapshot_locked(rt: Any, s: Any, name: Any, mode: SnapshotMode, *, internal: bool) -> Any:
        assert internal and s.lock.locked()
        return SimpleNamespace(id="snap1", mode=mode)

    async def settled(snapshot_id: str) -> None:
        return None

    snapshots = SimpleNamespace(runtime=SimpleNamespace(fork_mode=fork_mode), _snapshot_locked=snapshot_locked,
                                _settled=settled)  # fmt: skip
    sbx.lock = asyncio.Lock()
    return SimpleNamespace(table=Table(), snapshots=snapshots, sync=SimpleNamespace(publish_now=upload))


def _paused_sandbox() -> Any:
    row = _row(pause_mode=SnapshotMode.FULL, paused_at=5.0, access_token="tok")
    return SimpleNamespace(id=row.id, row=row, state=SandboxState.PAUSED)


async def test_the_binding_says_published_only_after_the_upload() -> None:
    sbx, directory = _paused_sandbox(), Published()

    async def upload(snap: Any) -> None:
        assert directory.published == []  # not before the snapshot is in the store

    h = PauseHandover(_orch(sbx, upload), directory)  # type: ignore[arg-type]
    await h._publish(sbx.id, 5.0)
    assert [(s, snap, row["access_token"]) for s, snap, row in directory.published] == [("sbx1", "snap1", "tok")]
    assert h._uploaded == {"sbx1": ["snap1"]}


async def test_a_resume_during_the_upload_records_nothing() -> None:
    sbx, directory = _paused_sandbox(), Published()

    async def upload(snap: Any) -> None:
        sbx.state, sbx.row.paused_at = SandboxState.RUNNING, None  # resumed meanwhile

    await PauseHandover(_orch(sbx, upload), directory)._publish(sbx.id, 5.0)  # type: ignore[arg-type]
    assert directory.published == []


async def test_a_failed_upload_records_nothing_and_the_pause_stands() -> None:
    sbx, directory = _paused_sandbox(), Published()

    async def upload(snap: Any) -> None:
        raise OSError("store unreachable")

    await PauseHandover(_orch(sbx, upload), directory)._publish(sbx.id, 5.0)  # type: ignore[arg-type]
    assert directory.published == [] and sbx.state is SandboxState.PAUSED


async def test_another_machines_pause_is_refused_before_the_binding_is_taken() -> None:
    tcg, kvm = {"accel": "tcg", "cpu": "max", "qemu": "7.2"}, {"accel": "kvm", "cpu": "EPYC #1", "qemu": "7.2"}
    taken: list[Any] = []

    class Adopting(Directory):
        def published_pause(self, sandbox_id: str) -> PublishedPause:
            return PublishedPause(sandbox_id, "n1", "gone", "snap1", carried(_row()), "")

        def adopt(self, pause: PublishedPause) -> None:
            taken.append(pause)

    async def fetch(snapshot_id: str) -> Any:
        return SimpleNamespace(id=snapshot_id, dir="/nonexistent")

    def check_restorable(row: Any) -> Any:  # as SnapshotFlows.check_restorable on a node of another machine
        raise MachineMismatch(f"snapshot '{row.id}' was taken on tcg", tcg, kvm)

    orch = SimpleNamespace(table=set(), settings=SimpleNamespace(default_timeout=300),
                           ctx=SimpleNamespace(check_timeout=lambda t: None), sync=SimpleNamespace(fetch=fetch),
                           snapshots=SimpleNamespace(check_restorable=check_restorable))  # fmt: skip
    with pytest.raises(MachineMismatch):
        await PauseHandover(orch, Adopting()).adopt("sbx1", None)  # type: ignore[arg-type]
    assert taken == []

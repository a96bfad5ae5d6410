"""Published pauses, the node's side without a cluster: what a pause carries to the adopting node, and
which lifecycle events publish or withdraw it."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from aenv.core.handover import CARRIED, PauseHandover, carried
from aenv.directory.node import PublishedPause
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

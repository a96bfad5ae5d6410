"""A sandbox's log lines: gathered in memory, written in batches in order (also from several threads at
once), read a page at a time by time, level and text, pruned by age."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from aenv.core.sandbox_logs import SandboxLogs
from aenv.kinds import SandboxState
from aenv.store.sqlite import SandboxRow, Store


def _row(sid: str) -> SandboxRow:
    return SandboxRow(id=sid, template_id="base", state=SandboxState.RUNNING, runtime="fake",
                      started_at=time.time(), end_at=time.time() + 60, cpu_count=1, memory_mb=256, disk_mb=1024)  # fmt: skip


def test_lines_keep_their_order_across_concurrent_flushes(tmp_path: Path) -> None:
    logs = SandboxLogs(Store(tmp_path / "db.sqlite"), retention_s=3600)
    row = _row("s1")

    def emit(k: int) -> None:
        for i in range(50):
            logs.on_event("paused" if i % 2 else "resumed", row, {"n": f"{k}-{i}"})
            if i % 10 == 0:
                logs.flush()

    threads = [threading.Thread(target=emit, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    logs.flush()
    events = logs.events.page("s1", limit=1000)
    assert len(events) == 200  # none lost
    for k in range(4):  # each thread's lines in the order it emitted them
        mine = [int(e.fields["n"].split("-")[1]) for e in events if e.fields["n"].startswith(f"{k}-")]
        assert mine == list(range(50))


def test_pages_by_time_level_and_text_and_pruning(tmp_path: Path) -> None:
    logs = SandboxLogs(Store(tmp_path / "db.sqlite"), retention_s=3600)
    logs.on_event("created", _row("s1"), {})
    logs.on_event("killed", _row("s1"), {"reason": "expired", "detail": "its timeout ran out"})
    logs.on_event("created", _row("s2"), {})
    logs.flush()
    assert [e.message for e in logs.events.page("s1", limit=10)] == [
        "sandbox created from template base", "sandbox ended (expired): its timeout ran out"]
    assert [e.level for e in logs.events.page("s1", limit=10, min_level="warn")] == ["warn"]
    assert len(logs.events.page("s1", limit=10, search="timeout")) == 1
    assert logs.events.page("s1", limit=1, forward=False)[0].message.startswith("sandbox ended")
    assert logs.events.page("s1", limit=10, cursor=time.time() + 5) == []
    assert logs.prune(time.time() + 1) == 3 and logs.events.page("s2", limit=10) == []

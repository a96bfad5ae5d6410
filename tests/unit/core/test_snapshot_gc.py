"""The snapshot collector takes internal snapshots nothing needs, never one still being written (a
concurrent build's collection once removed another build's step snapshot mid-capture)."""

from __future__ import annotations

from pathlib import Path

from aenv.config import Settings
from aenv.core.context import Context
from aenv.core.snapshots import SnapshotFlows
from aenv.core.table import SandboxTable
from aenv.core.templates import TemplateCatalog
from aenv.kinds import SnapshotMode
from aenv.store.sqlite import SnapshotRow, Store
from tests.fixtures.runtime import FakeRuntime


def _row(tmp: Path, sid: str, state: str) -> SnapshotRow:
    d = tmp / "snapshots" / sid
    (d / ".capture").mkdir(parents=True)
    return SnapshotRow(id=sid, template_id="base", runtime="fake", mode=SnapshotMode.FILESYSTEM, state=state,
                       created_at=0.0, dir=str(d), internal=True)  # fmt: skip


def test_an_internal_snapshot_being_written_is_not_collected(tmp_path: Path) -> None:
    settings = Settings(state_dir=tmp_path / "s", cache_dir=tmp_path / "c")
    settings.state_dir.mkdir()
    store = Store(settings.db_path)
    ctx = Context(settings, store, FakeRuntime(), TemplateCatalog(settings, store), SandboxTable())  # type: ignore[arg-type]
    flows = SnapshotFlows(ctx, None)  # type: ignore[arg-type]
    writing, done = _row(tmp_path, "writing", "creating"), _row(tmp_path, "unneeded", "ready")
    store.put_snapshot(writing)
    store.put_snapshot(done)
    flows.collect_garbage()
    assert store.get_snapshot("writing") is not None and (Path(writing.dir) / ".capture").is_dir()
    assert store.get_snapshot("unneeded") is None and not Path(done.dir).exists()
    store.close()

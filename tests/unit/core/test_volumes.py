"""Volumes' crash consistency and mount rules in core: a restart finishes a create or destroy that a
kill -9 cut short, and the mount parser refuses what cannot be a mount."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.core.table import SandboxTable
from aenv.core.volumes import Volumes, parse_mounts
from aenv.errors import InvalidRequest
from aenv.store.sqlite import Store
from aenv.store.volumes import CREATING, DESTROYING, READY, VolumeLog, VolumeRow
from tests.fixtures.runtime import FakeRuntime


def _row(vid: str, name: str, state: str) -> VolumeRow:
    return VolumeRow(id=vid, name=name, owner="", token="t" + vid, state=state, created_at=1.0)


async def test_start_finishes_what_a_crash_cut_short(tmp_path: Path) -> None:
    settings = Settings(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache")
    store = Store(settings.db_path)
    log = VolumeLog(store)
    for vid, state in (("half", CREATING), ("going", DESTROYING), ("kept", READY), ("lost", READY)):
        log.put(_row(vid, f"n-{vid}", state))
        if vid != "lost":
            (settings.volumes_dir / vid).mkdir(parents=True)
    (settings.volumes_dir / "kept" / "f").write_text("data")
    await Volumes(settings, store, FakeRuntime(), SandboxTable()).start()  # type: ignore[arg-type]
    assert [r.id for r in log.all()] == ["kept", "lost"]
    assert sorted(p.name for p in settings.volumes_dir.iterdir()) == ["kept", "lost"]
    assert (settings.volumes_dir / "kept" / "f").read_text() == "data"
    store.close()


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ([("v", "rel", False)], "absolute"),
        ([("v", "/", False)], "cannot be mounted"),
        ([("v", "/sys/fs", False)], "reserved"),
        ([("v", "/.aenv-run", False)], "reserved"),
        ([("v", "/a", False), ("w", "/a", False)], "inside"),
        ([("v", "/a", False), ("v:ro", "/b", False)], "twice"),
        ([("bad name", "/a", False)], "name"),
    ],
)
def test_parse_mounts_refuses(raw: list[tuple[str, str, bool]], fragment: str) -> None:
    with pytest.raises(InvalidRequest, match=fragment):
        parse_mounts(raw)


def test_parse_mounts_normalises_and_reads_ro() -> None:
    (m,) = parse_mounts([("v:ro", "/mnt//data/./x/", False)])
    assert (m.name, m.path, m.read_only) == ("v", "/mnt/data/x", True)

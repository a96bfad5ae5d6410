"""A snapshot's reported size: hard-linked files (a vm snapshot's base RAM) count their share only."""

from __future__ import annotations

import os
from pathlib import Path

from aenv.core.sync import disk_usage


def test_hard_linked_files_are_shared_not_counted_whole(tmp_path: Path) -> None:
    snap = tmp_path / "snap"
    snap.mkdir()
    (snap / "own").write_bytes(b"x" * 65536)
    base = tmp_path / "template-ram.img"
    base.write_bytes(b"r" * 4 * 65536)
    os.link(base, snap / "base.ram")
    own = (snap / "own").stat().st_blocks * 512
    shared = base.stat().st_blocks * 512
    assert disk_usage(snap) == own + shared // 2
    base.unlink()  # the snapshot is the only holder now: it counts whole
    assert disk_usage(snap) == own + shared

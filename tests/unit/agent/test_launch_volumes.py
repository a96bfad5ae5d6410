"""The launcher's volume mount points: made inside the root, never through a symlink of the image."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aenv.agent.launch import volume_point


def test_mount_point_is_made_inside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "mnt").mkdir(parents=True)
    assert volume_point(str(root), "/mnt/data/x") == f"{root}/mnt/data/x"
    assert (root / "mnt" / "data" / "x").is_dir()


def test_a_symlink_in_the_path_is_refused(tmp_path: Path) -> None:
    root, host = tmp_path / "root", tmp_path / "host"
    root.mkdir()
    host.mkdir()
    os.symlink(host, root / "mnt")
    with pytest.raises(ValueError, match="symlink"):
        volume_point(str(root), "/mnt/data")
    assert list(host.iterdir()) == []
    (root / "file").write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        volume_point(str(root), "/file/data")

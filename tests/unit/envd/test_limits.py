"""envd.limits: the vm guest's sandbox cgroup, on a fake cgroup2 tree."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aenv.envd import limits


def _tree(tmp_path: Path, controllers: str = "cpuset cpu io memory pids") -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (root / "cgroup.subtree_control").write_text("")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:         503808 kB\nMemFree:          400000 kB\nMemAvailable:     443392 kB\n")
    return root, meminfo


def test_apply_sets_limits_below_what_is_available_and_joins(tmp_path: Path) -> None:
    root, meminfo = _tree(tmp_path)
    assert limits.apply(300, 16, root, meminfo) == "pids:300;memory:417M"  # 433 MB available - 16
    cg = root / "sandbox"
    assert (root / "cgroup.subtree_control").read_text() == "+pids +memory"
    assert (cg / "pids.max").read_text() == "300"
    assert (cg / "memory.max").read_text() == str(417 * 1024 * 1024)
    assert (cg / "cgroup.procs").read_text() == str(os.getpid())
    assert limits.apply(300, None, root, meminfo) == "pids:300"  # again: the cgroup is reused


def test_apply_without_a_controller_says_so(tmp_path: Path) -> None:
    root, meminfo = _tree(tmp_path, "cpu io memory")
    with pytest.raises(OSError, match="pids"):
        limits.apply(300, 16, root, meminfo)
    assert not (root / "sandbox").exists()


def test_parse() -> None:
    assert limits.parse({}) is None
    assert limits.parse({"limits": {"pids": 4096, "memoryReserveMB": 16}}) == (4096, 16)
    assert limits.parse({"limits": {"pids": 10}}) == (10, None)
    for bad in ([], {"pids": 0}, {"pids": True}, {"memoryReserveMB": "16"}):
        with pytest.raises(ValueError):
            limits.parse({"limits": bad})

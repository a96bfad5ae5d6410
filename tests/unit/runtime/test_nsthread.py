"""``runtime/nsthread.py``: a thread in a private mount namespace spawns into it; the server never sees its mounts."""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

import pytest

from aenv.runtime.nsthread import in_private_mounts


def _mounted_at(mountinfo: str, path: Path) -> bool:
    return any(line.split()[4] == str(path) for line in mountinfo.splitlines())


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: mount(2)")
def test_a_mount_made_on_the_thread_is_seen_by_its_child_only(tmp_path: Path) -> None:
    target = tmp_path / "private"
    target.mkdir()
    libc = ctypes.CDLL(None, use_errno=True)

    def prepare() -> None:
        assert libc.mount(b"tmpfs", str(target).encode(), b"tmpfs", 0, None) == 0, os.strerror(ctypes.get_errno())
        (target / "made-here").write_text("x")

    child = in_private_mounts(prepare, lambda: subprocess.run(["cat", "/proc/self/mountinfo"], capture_output=True,
                                                              text=True, check=True).stdout, thread_name="test-mounts")
    assert _mounted_at(child, target)
    assert not _mounted_at(Path("/proc/self/mountinfo").read_text(), target) and not (target / "made-here").exists()


def test_an_error_while_preparing_is_raised_and_nothing_is_spawned(tmp_path: Path) -> None:
    spawned: list[bool] = []

    def prepare() -> None:
        raise OSError(13, "refused")

    with pytest.raises(OSError, match="refused"):
        in_private_mounts(prepare, lambda: spawned.append(True), thread_name="test-mounts")
    assert not spawned

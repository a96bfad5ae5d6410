"""The frozen RAM store: a ramfs that refuses hole punches, mounted idempotently, removed cleanly."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from pathlib import Path

import pytest

from aenv.runtime.vm import frozen

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a ramfs needs root")

PUNCH_HOLE_KEEP_SIZE = 0x02 | 0x01


def _punch(path: Path) -> int:
    """fallocate(PUNCH_HOLE) on the first 4 KiB: 0 or the errno (what QEMU's discard does)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    fd = os.open(path, os.O_RDWR)
    try:
        return 0 if libc.fallocate(fd, PUNCH_HOLE_KEEP_SIZE, 0, 4096) == 0 else ctypes.get_errno()
    finally:
        os.close(fd)


def test_store_refuses_hole_punch_where_tmpfs_allows_it(tmp_path: Path) -> None:
    shm = Path("/dev/shm") / f"aenv-unit-{os.getpid()}"
    try:
        plain = shm / "plain.mem"
        shm.mkdir()
        plain.write_bytes(b"x" * 8192)
        assert _punch(plain) == 0 and plain.read_bytes()[:1] == b"\0"  # tmpfs: the template would lose data

        store = shm / "frozen"
        store.mkdir()
        (store / "stale.mem").write_bytes(b"old")  # a pre-store RAM file is not kept
        frozen.ensure(store)
        frozen.ensure(store)  # idempotent: one mount
        assert frozen.is_frozen_store(store)
        assert not (store / "stale.mem").exists()
        mem = store / "tpl.mem"
        mem.write_bytes(b"y" * 8192)
        assert _punch(mem) == errno.EOPNOTSUPP
        assert mem.read_bytes() == b"y" * 8192
        assert len(frozen._mount_points_under(shm)) == 1
    finally:
        frozen.remove_tree(shm)
    assert not shm.exists()
    assert frozen._mount_points_under(shm) == []


def test_remove_tree_of_a_missing_dir_is_a_no_op(tmp_path: Path) -> None:
    frozen.remove_tree(tmp_path / "absent")


def test_copy_sparse_keeps_zero_pages_as_holes(tmp_path: Path) -> None:
    """ramfs says every byte is data; a guest RAM image written from it must not be fully allocated."""
    shm = Path("/dev/shm") / f"aenv-unit-copy-{os.getpid()}"
    try:
        frozen.ensure(shm)
        src = shm / "ram.mem"
        with src.open("wb") as f:
            f.truncate(16 * 2**20)
            f.seek(5 * 2**20)
            f.write(b"page" * 1024)
            f.seek(9 * 2**20)
            f.write(bytes(2**20))  # explicit zeros: allocated in ramfs, not worth a block on disk
        out = tmp_path / "ram.img"
        copied = frozen.copy_sparse(src, out)
        assert out.read_bytes() == src.read_bytes()
        assert copied == 64 * 1024 and out.stat().st_blocks * 512 <= 128 * 1024
        assert frozen.copy_sparse(out, shm / "back.mem") == copied  # and back into the store
    finally:
        frozen.remove_tree(shm)

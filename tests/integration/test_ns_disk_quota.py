"""The ns sandboxes volume on the real kernel: a loop-mounted btrfs image, a quota-limited subvolume
per sandbox root, shared use by two runtimes on one state dir, release and re-attach.
(The end-to-end check through the SDK is ``tests/reliability/test_isolation.py::test_disk_writes_bounded``.)"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.runtime.ns import disk


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("loop devices and mounts need root")
    state = tmp_path / "state"
    state.mkdir()
    why = disk.probe(state, state / "sandboxes")
    if why.startswith("unavailable"):
        pytest.skip(f"ns disk quota: {why}")
    yield state
    disk.DiskQuota(state, state / "sandboxes").release()  # whatever a failed test left
    assert disk.mount_at(state / "sandboxes") is None


def _write(path: Path, mib: int) -> int:
    """Write up to ``mib`` MiB (fsync each); return the MiB written before EDQUOT/ENOSPC."""
    done = 0
    try:
        with open(path, "ab") as fh:
            for _ in range(mib):
                fh.write(b"\1" * (1 << 20))
                fh.flush()
                os.fsync(fh.fileno())
                done += 1
    except OSError as exc:
        assert exc.errno in (errno.EDQUOT, errno.ENOSPC), exc
    return done


def test_volume_lifecycle_and_limits(state: Path) -> None:
    mount = state / "sandboxes"
    q = disk.DiskQuota(state, mount, size_mb=2048)
    q.setup()
    assert q.active and q.owned, q.describe()
    assert "quotas" in q.describe()
    image = state / disk.IMAGE_NAME
    assert image.stat().st_size == 2048 << 20
    assert image.stat().st_blocks * 512 < 64 << 20  # sparse
    assert disk.mount_at(mount) is not None

    # a pooled root: subvolume limited before upper/ exists, renamed into place at hand-out
    pooled = mount / disk.POOL_NAME / "pool-1"
    t0 = time.perf_counter()
    q.make_root(pooled, 8)
    made_ms = (time.perf_counter() - t0) * 1000
    assert disk.subvolume_id(pooled) is not None
    (pooled / "upper").mkdir()
    root = mount / "sbx1" / "ns"
    root.parent.mkdir()
    os.rename(pooled, root)
    assert _write(root / "upper" / "fill", 32) <= 8
    (root / "upper" / "fill").unlink()
    os.sync()
    q.limit(root, 24)  # hand-out with another disk size
    assert 8 < _write(root / "upper" / "fill", 32) <= 24
    os.sync()
    used = q.usage(root)
    assert used is not None and (8 << 20) < used <= 24 << 20
    q.make_root(root, 24)  # an existing root (rollback relaunch in place) keeps its subvolume
    assert (root / "upper" / "fill").exists()
    print(f"\nmake_root (subvolume + limit): {made_ms:.2f} ms")

    # a second runtime on the same state dir shares the volume; the last one out unmounts it
    other = disk.DiskQuota(state, mount)
    other.setup()
    assert other.active and other.fs == q.fs
    q.release()
    assert disk.mount_at(mount) is not None, "unmounted under another runtime"
    other.release()
    assert disk.mount_at(mount) is None
    assert not any(mount.iterdir())  # nothing was written beside the volume

    # the next start re-attaches the same image (no mkfs: the data is still there)
    again = disk.DiskQuota(state, mount)
    again.setup()
    assert again.active and again.fs == q.fs
    assert (root / "upper" / "fill").exists()
    disk.remove_tree(root.parent)
    assert not root.parent.exists()
    again.release()
    assert disk.mount_at(mount) is None

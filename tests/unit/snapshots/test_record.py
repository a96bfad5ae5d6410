"""The stored form of a snapshot result: the current keys, and records written before them."""

from __future__ import annotations

from aenv.kinds import SnapshotMode
from aenv.runtime.base import SnapshotResult
from aenv.snapshots.record import normalize


def test_a_result_survives_its_record() -> None:
    result = SnapshotResult(mode=SnapshotMode.FILESYSTEM, layers=("upper",), stack=("/s/1/upper",),
                            base_lowers=("/rootfs",), paused_ms=2.5, data={"compacted": False})
    back = SnapshotResult.from_record("filesystem", result.to_record(), parent="p1")
    assert back == SnapshotResult(mode=SnapshotMode.FILESYSTEM, layers=("upper",), stack=("/s/1/upper",),
                                  base_lowers=("/rootfs",), paused_ms=2.5, parent_snapshot="p1",
                                  data={"compacted": False})
    assert back.depth == 1 and back.mode is SnapshotMode.FILESYSTEM


def test_an_old_ns_record_keeps_its_stack_and_pause() -> None:
    old = {"layers": ["upper"], "data": {"lowers": ["/s2/upper", "/s1/upper", "/img/a", "/img/b"],
                                         "snapshot_depth": 2, "compacted": False, "paused_ms": 7}}
    rec = normalize(old)
    assert rec["stack"] == ["/s2/upper", "/s1/upper"] and rec["base_lowers"] == ["/img/a", "/img/b"]
    assert rec["paused_ms"] == 7 and rec["data"] == {"compacted": False}  # opaque again
    assert old["data"]["snapshot_depth"] == 2  # the input is not changed


def test_an_old_vm_record_moves_only_its_pause() -> None:
    rec = normalize({"layers": ["disk.qcow2"], "data": {"template_key": "k", "paused_ms": 51.2}})
    assert rec == {"layers": ["disk.qcow2"], "stack": [], "base_lowers": [], "paused_ms": 51.2,
                   "data": {"template_key": "k"}}


def test_depth_beyond_the_lowers_is_clamped_and_missing_records_are_empty() -> None:
    rec = normalize({"data": {"lowers": ["/a"], "snapshot_depth": 5}})
    assert rec["stack"] == ["/a"] and rec["base_lowers"] == []
    assert normalize(None) == {"layers": [], "stack": [], "base_lowers": [], "paused_ms": None, "data": {}}

"""Start-up clean-up helpers of the vm runtime that need no QEMU: orphaned template RAM, the disk
generation of a run dir, the kill of a recorded process that is no longer ours."""

from __future__ import annotations

import time
from pathlib import Path

from aenv.runtime.base import RuntimeState
from aenv.runtime.vm.reconcile import OWNER_FILE, disk_generation, kill_recorded, sweep_orphan_ram


def test_sweep_orphan_ram(tmp_path: Path) -> None:
    live_state = tmp_path / "state-live"
    live_state.mkdir()
    for name, owner in (("aenv-live", live_state), ("aenv-dead", tmp_path / "gone"), ("aenv-unmarked", None)):
        d = tmp_path / "shm" / name
        d.mkdir(parents=True)
        (d / "t.mem").write_bytes(b"x")
        if owner is not None:
            (d / OWNER_FILE).write_text(str(owner))
    removed = sweep_orphan_ram(tmp_path / "shm")
    assert [p.name for p in removed] == ["aenv-dead"]
    assert sorted(p.name for p in (tmp_path / "shm").iterdir()) == ["aenv-live", "aenv-unmarked"]


def test_disk_generation(tmp_path: Path) -> None:
    assert disk_generation(tmp_path) == 0
    for name in ("root.qcow2", "root.1.qcow2", "root.3.qcow2", "root.x.qcow2"):
        (tmp_path / name).touch()
    assert disk_generation(tmp_path) == 3


def test_kill_recorded_leaves_a_process_that_is_not_our_qemu() -> None:
    import os
    import subprocess

    proc = subprocess.Popen(["sleep", "30"])
    try:
        # until its exec, the child's command line is still this test process's (a busy host is slow)
        for _ in range(500):
            if Path(f"/proc/{proc.pid}/cmdline").read_bytes().startswith(b"sleep"):
                break
            time.sleep(0.01)
        kill_recorded(RuntimeState({"pid": proc.pid, "qmp": "/nonexistent/q.sock"}))
        kill_recorded(RuntimeState({"pid": "not-a-pid", "qmp": "x"}))
        assert proc.poll() is None  # its command line does not name that QMP socket
        kill_recorded(RuntimeState({"pid": proc.pid, "qmp": "30"}))  # now it does ("sleep 30")
        assert proc.wait(timeout=5) != 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, 9)
            proc.wait()

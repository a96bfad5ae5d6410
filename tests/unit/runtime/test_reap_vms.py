"""Test and bench servers' leftover QEMUs are found by their state dir and killed; others are not."""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import time
from pathlib import Path

from aenv.testing.server import reap_vms


def _fake_qemu(tmp_path: Path, *args: str) -> subprocess.Popen[bytes]:
    exe = tmp_path / "qemu-system-x86_64"
    if not exe.exists():
        exe.symlink_to("/bin/sh")  # a process whose command line looks like a QEMU's
    return subprocess.Popen([str(exe), "-c", "sleep 1000; :", "qemu", *args], start_new_session=True)


def test_reap_vms_kills_only_the_state_dirs_qemus(tmp_path: Path) -> None:
    state = tmp_path / "state"
    shm_marker = f"/dev/shm/aenv-{hashlib.sha256(str(state).encode()).hexdigest()[:10]}/frozen/t.mem"
    mine = [
        _fake_qemu(tmp_path, f"{state}/vm/run/abc/q.sock"),
        _fake_qemu(tmp_path, f"mem-path={shm_marker}"),  # a pool entry: only its template RAM names it
    ]
    other = _fake_qemu(tmp_path, "/somewhere/else/q.sock")
    try:
        time.sleep(0.1)  # exec done: /proc shows the new command lines
        killed = reap_vms(state)
        assert sorted(killed) == sorted(p.pid for p in mine)
        for p in mine:
            p.wait(timeout=5)
        assert other.poll() is None
    finally:
        for p in (*mine, other):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, 9)  # the shell and its sleep
            p.wait()


def test_discard_vm_state_removes_the_state_dirs_template_ram(tmp_path: Path) -> None:
    """A thrown-away test server's template RAM in /dev/shm goes with it; another state dir's stays."""
    from aenv.testing.server import discard_vm_state

    def shm_of(state: Path) -> Path:
        return Path("/dev/shm") / f"aenv-{hashlib.sha256(str(state.absolute()).encode()).hexdigest()[:10]}"

    mine, other = shm_of(tmp_path / "state"), shm_of(tmp_path / "other")
    try:
        for d, owner in ((mine, tmp_path / "state"), (other, tmp_path / "other")):
            (d / "frozen").mkdir(parents=True)
            (d / "frozen" / "t.mem").write_bytes(b"ram")
            (d / ".state-dir").write_text(str(owner))
        discard_vm_state(tmp_path / "state")
        assert not mine.exists() and (other / "frozen" / "t.mem").exists()
        (other / ".state-dir").write_text("/another/state")  # its owner file disagrees: left alone
        discard_vm_state(tmp_path / "other")
        assert (other / "frozen" / "t.mem").exists()
    finally:
        import shutil

        for d in (mine, other):
            shutil.rmtree(d, ignore_errors=True)


def test_discard_removes_the_short_run_root_a_long_state_dir_gets(tmp_path: Path) -> None:
    """VM sockets must fit AF_UNIX's limit: a long state dir's VMs run under /tmp/aenv-vm-<hash>, which
    a throwaway server's discard removes with the rest (the leftover check found one)."""
    from aenv.runtime.vm.runtime import run_root_for
    from aenv.testing.server import discard_vm_state

    state = tmp_path / ("x" * 80) / "state"
    run_root = run_root_for(state)
    assert not run_root.is_relative_to(state)
    (run_root / "sbx1").mkdir(parents=True)
    (run_root / "sbx1" / "qmp.sock").write_text("")
    discard_vm_state(state)
    assert not run_root.exists()

"""Harness processes end with what started them: SIGTERM unwinds like Ctrl-C, and a child armed with
``exit_with_parent`` is signalled when its parent dies, SIGKILL included. Real processes, no mocks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def _wait_gone(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def _harness(tmp_path: Path, cleanup_s: float = 0.0) -> subprocess.Popen[str]:
    """A Python process that sleeps inside ``try`` after ``unwind_on_signals()`` and, in its ``finally``,
    writes ``cleaning``, takes ``cleanup_s`` and writes ``cleaned``; it prints ``ready`` first."""
    script = tmp_path / "harness.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        from pathlib import Path
        from aenv.testing.procs import unwind_on_signals
        unwind_on_signals()
        out = Path(sys.argv[1])
        try:
            print("ready", flush=True)
            time.sleep(60)
        finally:
            (out / "cleaning").write_text("")
            time.sleep(float(sys.argv[2]))
            (out / "cleaned").write_text("yes")
    """))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path), str(cleanup_s)], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read() if proc.stderr else ""
    return proc


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, -signal.SIGINT)])
def test_a_signal_runs_the_finally_blocks(tmp_path: Path, sig: int, code: int) -> None:
    proc = _harness(tmp_path)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == code  # SIGINT: Python ends an uncaught KeyboardInterrupt by SIGINT (a shell says 130)
    assert (tmp_path / "cleaned").read_text() == "yes"
    assert signal.Signals(sig).name + ": stopping" in err


def test_a_second_signal_does_not_cut_the_clean_up_short(tmp_path: Path) -> None:
    proc = _harness(tmp_path, cleanup_s=1.5)  # a slow clean-up: the second SIGTERM lands in it
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while not (tmp_path / "cleaning").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 143
    assert (tmp_path / "cleaned").read_text() == "yes"
    assert "still cleaning up" in err


def test_a_child_armed_with_exit_with_parent_dies_with_a_sigkilled_parent(tmp_path: Path) -> None:
    body = """
        import subprocess, sys, time
        from aenv.testing.procs import exit_with_parent
        child = subprocess.Popen(["sleep", "120"], preexec_fn=exit_with_parent(), start_new_session=True)
        print(child.pid, flush=True)
        print("ready", flush=True)
        time.sleep(120)
    """
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(body))
    parent = subprocess.Popen([sys.executable, str(script)], env=ENV, stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert parent.stdout.readline().strip() == "ready"
    assert _alive(child)
    parent.kill()
    parent.communicate(timeout=10)
    assert _wait_gone(child), f"pid {child} outlived its SIGKILLed parent"


def test_no_death_signal_off_the_main_thread() -> None:
    """The kernel signals when the forking *thread* ends: a worker thread's child must not get it."""
    import threading

    from aenv.testing.procs import exit_with_parent

    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(exit_with_parent()))
    t.start()
    t.join()
    assert got == [None]
    assert callable(exit_with_parent())

"""Processes a cluster command owns: stopped by their own id, reaped, never found by name."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout`` seconds; returns once it is reaped."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((d / "stat").read_text().rsplit(") ", 1)[1].split()[1])
                out.setdefault(ppid, []).append(int(d.name))
    return out


def machine_pids(root: int | None, cgroup_marker: str, path_marker: str) -> set[int]:
    """What one machine of a local cluster runs: ``root`` and its descendants, every process in a cgroup
    whose path contains ``cgroup_marker`` (a node's sandboxes, which their server no longer parents once
    it restarted), and every process whose command line names ``path_marker`` (the node's directory)."""
    kids = _children()
    found: set[int] = set()
    todo = [root] if root else []
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += kids.get(pid, [])
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if cgroup_marker in (d / "cgroup").read_text():
                found.add(int(d.name))
                continue
            if path_marker in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                found.add(int(d.name))
    return found


def kill_all(pids: set[int]) -> None:
    """SIGKILL each (what power loss does: no handler runs)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

"""``runtime/ns/checkpoint.py``: CRIU's failure reasons, the ready hook, and which sockets count as the host's."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from aenv.runtime.ns import checkpoint, criu


def test_reason_keeps_the_errors_that_matter(tmp_path: Path) -> None:
    log = tmp_path / "dump.log"
    log.write_text(
        "(00.03) Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted\n"
        "(00.04) some info\n"
        "(00.05) Error (criu/files-reg.c:1790): Can't lookup mount=27 for fd=-3 path=/x.so\n"
        "(00.05) Error (criu/cr-dump.c:1440): Collect mappings (pid: 2552) failed with -1\n"
        "(00.08) Error (criu/cr-dump.c:1975): Dumping FAILED.\n")
    assert checkpoint.reason(log) == ("Can't lookup mount=27 for fd=-3 path=/x.so; "
                                      "Collect mappings (pid: 2552) failed with -1")
    assert "no log" in checkpoint.reason(tmp_path / "missing.log")


def test_run_criu_raises_with_the_reason(tmp_path: Path) -> None:
    log = tmp_path / "restore.log"
    log.write_text("(00.1) Error (criu/x.c:1): the real cause\n")
    with pytest.raises(checkpoint.CheckpointError, match="criu restore failed: the real cause"):
        checkpoint.run_criu(["/bin/false"], log, "restore")
    checkpoint.run_criu(["/bin/true"], log, "restore")


needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="needs root for a network namespace")


@needs_root
def test_run_criu_calls_on_ready_in_the_fresh_netns_while_criu_runs(tmp_path: Path) -> None:
    """The filter goes into the restore's network namespace while CRIU runs: the wrapper's pid names
    it from the ready line on, and the command waits here until the call has been made."""
    go = tmp_path / "go"
    seen: list[tuple[int, int]] = []

    def on_ready(pid: int) -> None:
        seen.append((os.stat(f"/proc/{pid}/ns/net").st_ino, os.stat("/proc/self/ns/net").st_ino))
        go.touch()

    wait = ["/bin/sh", "-c", f'while [ ! -e {go} ]; do sleep 0.01; done']
    checkpoint.run_criu(criu.in_fresh_netns_argv(wait, ready=True), tmp_path / "x.log", "restore", on_ready=on_ready)
    assert len(seen) == 1 and seen[0][0] != seen[0][1]


@needs_root
def test_run_criu_kills_criu_when_on_ready_fails(tmp_path: Path) -> None:
    def on_ready(pid: int) -> None:
        raise OSError("no filter")

    forever = ["/bin/sh", "-c", "while :; do sleep 1; done"]
    with pytest.raises(OSError, match="no filter"):
        checkpoint.run_criu(criu.in_fresh_netns_argv(forever, ready=True), tmp_path / "x.log", "restore",
                            on_ready=on_ready)


def test_host_sockets_are_those_of_another_netns() -> None:
    """Our own sockets are of our namespace; one a process in another namespace holds is the host's
    (seen from that process's side, as a quiesce sees the server's connections into a sandbox)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s, socket.socket() as t:
        s.bind(f"\0aenv-test-{os.getpid()}")
        t.bind(("127.0.0.1", 0))
        t.listen()
        assert checkpoint.host_sockets([os.getpid()], os.getpid()) == []
        other = subprocess.Popen(["unshare", "--net", "sleep", "30"])
        try:
            _wait_other_netns(other.pid)
            inodes = {os.fstat(x.fileno()).st_ino for x in (s, t)}
            assert {i for _, i in checkpoint.host_sockets([os.getpid()], other.pid)} >= inodes
        finally:
            other.kill()
            other.wait()


def _wait_other_netns(pid: int) -> None:
    for _ in range(200):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net"):
                return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} never left our network namespace")


def test_host_sockets_asks_each_socket_once(monkeypatch: pytest.MonkeyPatch) -> None:
    held = [(7, 3, 100), (7, 4, 200)]
    asked: list[int] = []
    monkeypatch.setattr(checkpoint.sockets, "held_sockets", lambda pids: list(held))
    monkeypatch.setattr(checkpoint.sockets, "netns_inode",
                        lambda pid, fd: asked.append(fd) or (ours if fd != 4 else ours + 1))
    ours = os.stat("/proc/self/ns/net").st_ino
    seen: dict[str, set[int]] = {"inside": set(), "outside": set()}
    me = os.getpid()
    assert checkpoint.host_sockets([7], me, seen) == [(7, 200)] and asked == [3, 4]
    assert checkpoint.host_sockets([7], me, seen) == [(7, 200)] and asked == [3, 4]  # nothing new: not asked again
    held.append((7, 5, 300))  # made inside since: asked, and it is the sandbox's own
    assert checkpoint.host_sockets([7], me, seen) == [(7, 200)] and asked == [3, 4, 5]
    held.remove((7, 4, 200))
    assert checkpoint.host_sockets([7], me, seen) == []


def test_wait_no_host_sockets_times_out_with_the_culprit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpoint, "host_sockets", lambda pids, init, seen: [(41, 609273)])
    with pytest.raises(checkpoint.CheckpointError, match="pid 41 socket 609273"):
        checkpoint.wait_no_host_sockets(lambda: [41], 41, timeout=0.01)


def test_kdat_cache_drops_a_stale_tmp_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CRIU's failed save leaves criu.kdat.tmp behind and then never saves again (O_EXCL): an old one goes."""
    from aenv.runtime.ns import criu

    monkeypatch.setattr(criu, "KDAT_BASE", tmp_path)
    monkeypatch.setattr(criu.kdat_dir, "__defaults__", (tmp_path,))
    d = checkpoint.kdat_cache("/opt/criu")
    assert d is not None and d.is_dir() and d.parent == tmp_path
    stale = d / "criu.kdat.tmp"
    stale.write_bytes(b"")
    os.utime(stale, (1, 1))
    assert checkpoint.kdat_cache("/opt/criu") == d and not stale.exists()
    fresh = d / "criu.kdat.tmp"
    fresh.write_bytes(b"")  # another CRIU saving right now: left alone
    assert checkpoint.kdat_cache("/opt/criu") == d and fresh.exists()


def test_sweep_stages_removes_only_old_empty_stage_dirs(tmp_path: Path) -> None:
    """A SIGKILL between a restore's mkdtemp and its finally leaves an empty stage dir; the next start
    removes it, but never a young one (another server's running restore) nor one with content."""
    from aenv.runtime.ns.checkpoint import STAGE_MAX_AGE, STAGE_PREFIX, sweep_stages

    old, young, full, other = (tmp_path / n for n in (f"{STAGE_PREFIX}old", f"{STAGE_PREFIX}young",
                                                       f"{STAGE_PREFIX}full", "unrelated"))
    for d in (old, young, full, other):
        d.mkdir()
    (full / "x").write_text("kept")
    now = time.time()
    for d in (old, full, other):
        os.utime(d, (now - STAGE_MAX_AGE - 5, now - STAGE_MAX_AGE - 5))
    assert sweep_stages(tmp_path, now=now) == [old.name]
    assert not old.exists() and young.is_dir() and (full / "x").read_text() == "kept" and other.is_dir()


def test_wait_no_host_sockets_waits_for_queued_connections_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection queued on a channel listener is accepted first: only then are held sockets asked
    for (one accepted in between is then seen held); one never accepted names the listener."""
    queued = [True, True, False]
    asked: list[int] = []
    monkeypatch.setattr(checkpoint.sockets, "unix_listeners", lambda pids, under: [(41, 5)] if under == "/run" else [])
    monkeypatch.setattr(checkpoint.sockets, "has_queued", lambda pid, fd: queued.pop(0))
    monkeypatch.setattr(checkpoint, "host_sockets", lambda pids, init, seen: asked.append(len(queued)) or [])
    checkpoint.wait_no_host_sockets(lambda: [41], 41, timeout=5, channels="/run")
    assert asked == [0]
    monkeypatch.setattr(checkpoint.sockets, "has_queued", lambda pid, fd: True)
    with pytest.raises(checkpoint.CheckpointError, match="accepted on a socket of pid 41"):
        checkpoint.wait_no_host_sockets(lambda: [41], 41, timeout=0.01, channels="/run")

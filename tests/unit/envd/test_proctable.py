"""Process end events and the process table driven directly (no HTTP)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from aenv.envd.errors import InvalidArgument, NotFound
from aenv.envd.identity import User
from aenv.envd.proctable import (
    SUBSCRIBER_HIGH_WATER,
    ProcessConfig,
    ProcessTable,
    SpawnRequest,
    end_event,
    shell_for,
)


def test_end_event_shapes() -> None:
    assert end_event(0) == {"exitCode": 0, "exited": True, "status": "exit status 0"}
    assert end_event(3) == {
        "exitCode": 3,
        "exited": True,
        "status": "exit status 3",
        "error": "exit status 3",
    }
    killed = end_event(-signal.SIGKILL)
    assert killed == {"exitCode": -1, "exited": False, "status": "signal: killed", "error": "signal: killed"}
    assert end_event(-signal.SIGTERM)["status"] == "signal: terminated"


def test_bash_falls_back_to_sh_when_missing() -> None:
    assert shell_for("/bin/bash", exists=lambda p: False) == "/bin/sh"
    assert shell_for("/bin/bash", exists=lambda p: True) == "/bin/bash"
    assert shell_for("/usr/bin/env", exists=lambda p: False) == "/usr/bin/env"


def _me() -> User:
    return User("me", os.geteuid(), os.getegid(), "/tmp", tuple(os.getgroups()))


def _request(
    cmd: str, cwd: str = "/tmp", pty: tuple[int, int] | None = None, stdin: bool = False
) -> SpawnRequest:
    config = ProcessConfig("/bin/sh", ["-c", cmd], {}, None)
    return SpawnRequest(
        config, _me(), {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, cwd, pty_size=pty, stdin=stdin
    )


async def _collect(queue: asyncio.Queue) -> list[dict]:  # type: ignore[type-arg]
    events = []
    while (event := await asyncio.wait_for(queue.get(), 20)) is not None:
        events.append(event)
    return events


async def test_spawn_streams_output_and_end() -> None:
    table = ProcessTable()
    proc = table.spawn(_request("printf out; printf err >&2; exit 4"))
    events = await _collect(proc.subscribe())
    import base64

    stdout = b"".join(base64.b64decode(e["data"]["stdout"]) for e in events if "stdout" in e.get("data", {}))
    stderr = b"".join(base64.b64decode(e["data"]["stderr"]) for e in events if "stderr" in e.get("data", {}))
    assert (stdout, stderr) == (b"out", b"err")
    assert events[-1] == {"end": end_event(4)}
    with pytest.raises(NotFound):
        table.get(proc.pid)
    assert table.retained_exit(pid=proc.pid) == end_event(4)


async def test_missing_cwd_rejected(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="does not exist"):
        ProcessTable().spawn(_request("true", cwd=str(tmp_path / "missing")))


async def test_output_without_subscriber_is_dropped_and_process_survives(tmp_path: Path) -> None:
    import base64
    import fcntl
    import struct
    import termios

    marker = tmp_path / "written"
    table = ProcessTable()
    proc = table.spawn(_request(f"head -c 1000000 /dev/zero; touch {marker}; read x; echo late", stdin=True))
    stdout_fd = next(fd for fd, kind in proc.out_fds.items() if kind == "stdout")

    def pending() -> int:
        return struct.unpack("i", fcntl.ioctl(stdout_fd, termios.FIONREAD, b"\0\0\0\0"))[0]

    for _ in range(4000):  # wait until the megabyte was produced and read with nobody listening
        if marker.exists() and pending() == 0:
            break
        await asyncio.sleep(0.005)
    queue = proc.subscribe()
    await proc.write_input(b"\n", pty=False)
    events = await _collect(queue)
    data = b"".join(base64.b64decode(e["data"]["stdout"]) for e in events if "data" in e)
    assert data == b"late\n"
    assert events[-1]["end"]["exitCode"] == 0


async def test_pty_resize_and_wrong_input_kind() -> None:
    from aenv.envd.errors import Internal

    table = ProcessTable()
    proc = table.spawn(_request("read x; stty size", pty=(80, 24)))
    queue = proc.subscribe()
    proc.resize(100, 33)
    with pytest.raises(Internal):
        await proc.write_input(b"x", pty=False)
    await proc.write_input(b"\n", pty=True)
    events = await _collect(queue)
    import base64

    data = b"".join(base64.b64decode(e["data"]["pty"]) for e in events if "data" in e)
    assert b"33 100" in data


async def test_slow_subscriber_pauses_reading_without_losing_output() -> None:
    import base64

    table = ProcessTable()
    proc = table.spawn(_request("head -c 5000000 /dev/zero"))
    queue = proc.subscribe()
    for _ in range(2000):  # nobody consumes: the queue fills to the high-water mark
        if proc._paused:
            break
        await asyncio.sleep(0.005)
    assert proc._paused  # reading stopped instead of buffering without bound
    assert queue.qsize() <= SUBSCRIBER_HIGH_WATER + 1
    total = 0
    while True:
        event = await asyncio.wait_for(queue.get(), 20)
        proc.maybe_resume()
        if event is None:
            break
        if "data" in event:
            total += len(base64.b64decode(event["data"]["stdout"]))
    assert total == 5_000_000


async def test_two_subscribers_both_receive_output() -> None:
    import base64

    table = ProcessTable()
    proc = table.spawn(_request("read x; echo shared", stdin=True))
    first, second = proc.subscribe(), proc.subscribe()
    await proc.write_input(b"\n", pty=False)
    for queue in (first, second):
        events = await _collect(queue)
        data = b"".join(base64.b64decode(e["data"]["stdout"]) for e in events if "data" in e)
        assert data == b"shared\n"


async def test_blocked_stdin_write_is_aborted_when_process_exits(tmp_path: Path) -> None:
    """A grandchild keeps a full stdin pipe open; the writer must not hang the end event."""
    from aenv.envd.errors import Internal

    table = ProcessTable()
    proc = table.spawn(_request("sleep 30 <&0 & exit 0", stdin=True))
    queue = proc.subscribe()
    with pytest.raises(Internal):
        await asyncio.wait_for(proc.write_input(b"x" * (4 * 1024 * 1024), pty=False), 20)
    events = await _collect(queue)
    assert events[-1]["end"]["exitCode"] == 0
    import contextlib

    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the orphaned sleep


async def test_sigkill_answers_once_the_pid_is_gone() -> None:
    """SendSignal(SIGKILL) returns after the reap: the caller's next ``kill -0 <pid>`` (the SDK suite's
    test_kill_process) must not find the process or its zombie, however busy the host."""
    from typing import Any, cast

    from aenv.envd.connect import CallContext
    from aenv.envd.process import ProcessService

    table = ProcessTable()
    # a grandchild keeps the output pipe open: the reap must not wait for the output to close
    proc = table.spawn(_request("sleep 30 & exec sleep 30"))
    service = ProcessService(cast(Any, None), table)
    await service.send_signal({"process": {"pid": proc.pid}, "signal": "SIGNAL_SIGKILL"}, CallContext())
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)
    assert proc.reaped.is_set()
    table.kill_all()

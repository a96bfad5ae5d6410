"""The async e2b SDK: create, commands, streaming WatchDir, PTY, pause/connect."""

from __future__ import annotations

import asyncio

import pytest
from e2b import AsyncSandbox, CommandExitException, FilesystemEventType, PtySize, TimeoutException


async def test_async_lifecycle_commands_files(e2b_env: dict[str, str]) -> None:
    sbx = await AsyncSandbox.create("base", envs={"ASYNC": "yes"})
    try:
        r = await sbx.commands.run("echo $ASYNC && uname -s")
        assert r.stdout.split() == ["yes", "Linux"]
        with pytest.raises(CommandExitException):
            await sbx.commands.run("exit 7")
        await sbx.files.write("/home/user/x.txt", "async-data")
        assert await sbx.files.read("/home/user/x.txt") == "async-data"
        assert [e.name for e in await sbx.files.list("/home/user") if e.name == "x.txt"] == ["x.txt"]
        h = await sbx.commands.run("sleep 0.3; echo bg", background=True)
        assert (await h.wait()).stdout.strip() == "bg"
        info = await sbx.get_info()
        assert info.sandbox_id == sbx.sandbox_id
    finally:
        await sbx.kill()


async def test_async_watch_dir_stream(e2b_env: dict[str, str]) -> None:
    sbx = await AsyncSandbox.create("base")
    try:
        await sbx.files.make_dir("/home/user/aw")
        events = []
        handle = await sbx.files.watch_dir("/home/user/aw", on_event=events.append, recursive=True)
        await sbx.files.write("/home/user/aw/f.txt", "1")
        await sbx.commands.run("mkdir /home/user/aw/d && touch /home/user/aw/d/g.txt")
        for _ in range(600):  # up to 30 s: slow guests (TCG on a busy host)
            if any(e.name == "d/g.txt" for e in events):
                break
            await asyncio.sleep(0.05)
        await handle.stop()
        assert any(e.name == "f.txt" and e.type == FilesystemEventType.CREATE for e in events)
        assert any(e.name == "d/g.txt" for e in events)
    finally:
        await sbx.kill()


async def test_async_pty_and_pause(e2b_env: dict[str, str]) -> None:
    sbx = await AsyncSandbox.create("base")
    try:
        data: list[bytes] = []
        term = await sbx.pty.create(PtySize(rows=10, cols=40), on_data=data.append, timeout=0)
        await sbx.pty.send_stdin(term.pid, b"echo async-$((6*7))\n")
        for _ in range(600):  # up to 30 s: slow guests (TCG on a busy host)
            if b"async-42" in b"".join(data):
                break
            await asyncio.sleep(0.05)
        assert b"async-42" in b"".join(data)
        await sbx.files.write("/home/user/keep.txt", "kept")
        assert await sbx.pause() is True
        again = await AsyncSandbox.connect(sbx.sandbox_id)
        assert await again.files.read("/home/user/keep.txt") == "kept"
        assert await again.is_running()
    finally:
        await sbx.kill()


async def test_async_command_timeout_is_a_timeout(e2b_env: dict[str, str]) -> None:
    """A command past its ``timeout`` raises TimeoutException in the async SDK too: envd ends the
    stream with ``deadline_exceeded`` at the deadline (as E2B's does) and kills the process, instead
    of sending the killed process's end event (which the SDK reads as exit code -1)."""
    sbx = await AsyncSandbox.create("base")
    try:
        with pytest.raises(TimeoutException):
            await sbx.commands.run("sleep 30", timeout=2)
        for _ in range(400):  # the kill is asynchronous; a slow guest (TCG) needs a while
            if not any("sleep 30" in " ".join(p.args) for p in await sbx.commands.list()):
                break
            await asyncio.sleep(0.05)
        assert not any("sleep 30" in " ".join(p.args) for p in await sbx.commands.list())
    finally:
        await sbx.kill()

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from aenv.agent.main import child_env, python_argv
from aenv.agent.supervisor import Reaper, Supervised, spawn


async def test_supervised_child_is_restarted_and_zombies_reaped(tmp_path: Path) -> None:
    loop = asyncio.get_running_loop()
    reaper = Reaper(loop)
    reaper.install()
    try:
        marker = tmp_path / "runs"
        child = Supervised("flaky", ["/bin/sh", "-c", f"echo x >> {marker}; exit 3"], {"PATH": "/bin:/usr/bin"})
        reaper.supervise(child)
        for _ in range(200):
            if child.restarts >= 2:
                break
            await asyncio.sleep(0.02)
        assert child.restarts >= 2
        assert len(marker.read_text().split()) >= 2
        child.stop()
        orphan = spawn(["/bin/sh", "-c", "exit 0"], {"PATH": "/bin"})
        for _ in range(100):
            try:
                os.kill(orphan, 0)
            except ProcessLookupError:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("exited child was not reaped")
    finally:
        loop.remove_signal_handler(__import__("signal").SIGCHLD)


def test_child_env_and_python_argv() -> None:
    env = child_env({"FOO": "1", "PATH": "/custom"})
    assert env["FOO"] == "1" and env["PATH"] == "/custom" and env["HOME"] == "/root"
    assert not any(k.startswith("LD_") for k in env)
    argv = python_argv()
    assert argv[-1] == "-I"

from __future__ import annotations

import asyncio
import os
import subprocess

from aenv.runtime.process import ProcRef, Reaped, proc_start_time


def test_procref_of_self_and_stale_start_time() -> None:
    me = ProcRef.of(os.getpid())
    assert me is not None and me.alive()
    stale = ProcRef(os.getpid(), me.start + 1)
    assert not stale.alive()
    stale.kill()  # must not signal us: the start time does not match
    assert proc_start_time(2**22 + 12345) is None


async def test_reaped_child_is_waited_and_aclose_is_idempotent() -> None:
    child = Reaped.spawn(["sleep", "30"], stdout=subprocess.DEVNULL)
    ref = ProcRef.of(child.pid)
    assert ref is not None and ref.alive()
    await child.aclose()
    await child.aclose()
    assert child.proc.returncode is not None
    assert not ref.alive()
    quick = Reaped.spawn(["true"])
    async with asyncio.timeout(5):
        assert await quick.exited == 0


def test_wait_gone_for_non_child() -> None:
    p = subprocess.Popen(["sleep", "30"])
    ref = ProcRef.of(p.pid)
    assert ref is not None
    assert not ref.wait_gone(0.05)
    ref.kill()
    p.wait()
    assert ref.wait_gone(1.0)


async def test_async_readline_and_wait_gone() -> None:
    child = Reaped.spawn(["sh", "-c", "printf 'first line\\nsecond'; sleep 30"], stdout=subprocess.PIPE)
    assert await child.readline() == b"first line\n"
    ref = ProcRef.of(child.pid)
    assert ref is not None
    assert not await ref.wait_gone_async(0.05)
    child.kill()
    assert await ref.wait_gone_async(5.0)
    await child.aclose()

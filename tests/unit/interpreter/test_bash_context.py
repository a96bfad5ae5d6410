"""BashContext: an abandon that lands while the process is still being spawned is not lost."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from aenv.interpreter import kernels
from aenv.interpreter.kernels import BashContext, ContextInfo


async def test_abandon_during_spawn_still_stops_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = BashContext(ContextInfo("c1", "bash", str(tmp_path)), {"PATH": "/usr/bin:/bin"})
    real_spawn = asyncio.create_subprocess_exec

    async def spawn_then_client_leaves(*args: Any, **kw: Any) -> Any:
        proc = await real_spawn(*args, **kw)
        await ctx.abandon()  # what the service does on disconnect; no process is known to ctx yet
        return proc

    monkeypatch.setattr(kernels.asyncio, "create_subprocess_exec", spawn_then_client_leaves)
    marker = tmp_path / "finished"
    lines: list[dict[str, Any]] = []
    t0 = time.monotonic()
    await asyncio.wait_for(ctx.run(f"sleep 3; touch {marker}", {}, {}, lines.append), 10)
    assert time.monotonic() - t0 < 2.5, "the run was not interrupted"
    assert not marker.exists()
    assert any(line.get("type") == "error" for line in lines), lines

    # the next run starts clean (the pending interrupt was consumed by the abandoned one)
    monkeypatch.setattr(kernels.asyncio, "create_subprocess_exec", real_spawn)
    lines.clear()
    await ctx.run("echo next", {}, {}, lines.append)
    assert [x["text"] for x in lines if x.get("type") == "stdout"] == ["next\n"]
    await ctx.aclose()

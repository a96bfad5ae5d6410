"""A sandbox's pause and resume transitions: its row written around the runtime's call, lock held.

Its own module because several of the orchestrator's actions end in one of these two steps (a pause,
the reaper's expiry, a connect, the proxy's autoResume), and the rule that makes a crash between the
store and the runtime recoverable belongs in one place. The caller holds the sandbox's lock, has
checked its state, and reports the change itself (``on_running`` hooks, events).

A pause keeps memory (``full``) or only the files (``filesystem``: every process ends, the resume is
a cold start with a new boot id). The row's ``pause_mode`` says which *before* the runtime acts, and
a resume that discards memory says ``filesystem`` first too, so recovery after a crash settles such
a sandbox as stopped instead of mistaking its ended processes for a lost sandbox.
"""

from __future__ import annotations

import contextlib
import logging

from aenv.core.context import Context
from aenv.core.models import SandboxState
from aenv.core.table import LiveSandbox
from aenv.errors import GuestUnresponsive
from aenv.faults import fault_point
from aenv.kinds import SnapshotMode
from aenv.runtime.base import RuntimeState
from aenv.store.sqlite import now

log = logging.getLogger("aenv.core")


async def pause_locked(ctx: Context, sbx: LiveSandbox, keep_memory: bool = True) -> None:
    """Pause a running sandbox, keeping its memory or (``keep_memory=False``) its files only."""
    mode = SnapshotMode.FULL if keep_memory else SnapshotMode.FILESYSTEM
    step = "pause" if keep_memory else "pause.fs"
    sbx.row.state, sbx.row.pause_mode = SandboxState.PAUSING, mode
    ctx.store.update_sandbox(sbx.id, state=sbx.row.state, pause_mode=mode)
    try:
        fault_point(f"{step}.stored")
        state = await ctx.runtime.pause(sbx.id, keep_memory=keep_memory)
    except BaseException:
        sbx.row.state, sbx.row.pause_mode = SandboxState.RUNNING, None
        ctx.store.update_sandbox(sbx.id, state=sbx.row.state, pause_mode=None)
        raise
    fault_point(f"{step}.done")
    sbx.row.state = SandboxState.PAUSED
    sbx.row.paused_at = now()
    sbx.row.runtime_state = state.data
    ctx.store.update_sandbox(
        sbx.id, state=sbx.row.state, paused_at=sbx.row.paused_at, runtime_state=state.data
    )
    log.info("sandbox=%s paused (%s)", sbx.id, mode)


async def resume_locked(ctx: Context, sbx: LiveSandbox, timeout: int, keep_memory: bool = True) -> None:
    """Resume a paused sandbox for ``timeout`` seconds; cold (a new boot on its files) where it kept
    only its files or ``keep_memory`` is false."""
    cold = not keep_memory or sbx.row.pause_mode is SnapshotMode.FILESYSTEM
    step = "resume.cold" if cold else "resume"
    sbx.row.state = SandboxState.RESUMING
    if cold:  # from here on its memory is gone, whatever happens
        sbx.row.pause_mode = SnapshotMode.FILESYSTEM
    ctx.store.update_sandbox(sbx.id, state=sbx.row.state, pause_mode=sbx.row.pause_mode)
    try:
        fault_point(f"{step}.stored")
        state = await ctx.runtime.resume(sbx.id, RuntimeState(sbx.row.runtime_state), keep_memory=not cold)
    except BaseException:
        sbx.row.state = SandboxState.PAUSED
        if cold:  # the runtime may have ended its processes already: settle it as stopped
            with contextlib.suppress(Exception):
                sbx.row.runtime_state = (await ctx.runtime.pause(sbx.id, keep_memory=False)).data
        ctx.store.update_sandbox(sbx.id, state=sbx.row.state, runtime_state=sbx.row.runtime_state)
        raise
    fault_point(f"{step}.done")
    sbx.row.state = SandboxState.RUNNING
    sbx.row.paused_at = sbx.row.pause_mode = None
    sbx.row.end_at = now() + timeout
    sbx.row.runtime_state = state.data
    ctx.store.update_sandbox(
        sbx.id, state=sbx.row.state, paused_at=None, pause_mode=None, end_at=sbx.row.end_at,
        runtime_state=state.data,
    )
    log.info("sandbox=%s resumed%s", sbx.id, " (cold start)" if cold else "")


async def expiry_keeps_memory(ctx: Context, sbx: LiveSandbox) -> bool:
    """Whether the expiry pause of ``sbx`` keeps its memory: as autoPauseMemory says, unless envd does
    not answer. Then its files cannot be made consistent: everything is kept instead of nothing (the
    pause then says full, as it is)."""
    keep_memory = sbx.row.auto_pause_memory
    if not keep_memory:
        try:
            await ctx.check_guest(sbx.id)
        except GuestUnresponsive as exc:
            log.warning("sandbox=%s expiry pause keeps memory: %s", sbx.id, exc)
            keep_memory = True
    return keep_memory

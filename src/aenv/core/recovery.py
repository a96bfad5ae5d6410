"""Recovery at start: the store's sandboxes re-adopted from the runtime, or cleaned up.

The store is the truth across a ``kill -9``: a sandbox that was running or paused is adopted again
(with its network policy, or not at all); one caught mid-pause or mid-resume is settled towards the
safe side, paused; anything in between (starting, killing) is removed, files and all. Then the
runtime drops what no row names (``reconcile``). In cluster mode a node first claims its sandboxes in
the cluster directory under its new incarnation; those the directory no longer binds to it (it was
declared dead meanwhile, or the id lives elsewhere now) are killed: declared dead means dead.
"""

from __future__ import annotations

import contextlib
import logging

from aenv.core import network as net
from aenv.core.context import Context
from aenv.core.models import SandboxState
from aenv.core.table import LiveSandbox
from aenv.errors import AenvError
from aenv.kinds import SnapshotMode
from aenv.store.gone_log import KILLED, LOST
from aenv.store.sqlite import now

log = logging.getLogger("aenv.core")


async def recover(ctx: Context) -> None:
    """Re-adopt what survived a restart; clean up what did not. Nothing is left half-made."""
    rows = ctx.store.list_sandboxes()
    binder = ctx.store.binder
    disowned = binder.claim([r.id for r in rows]) if binder is not None else {}
    for row in rows:
        ctx.table.saw_seq(row.created_seq)
        if row.id in disowned:
            log.warning("sandbox=%s recovery: %s; killing it", row.id, disowned[row.id])
            await ctx.forget(row, LOST, disowned[row.id])
            continue
        state = SandboxState(row.state)
        try:
            spec = ctx.spec_for(row)
        except AenvError as exc:
            log.warning("sandbox=%s recovery: %s; removing", row.id, exc)
            await ctx.forget(row, LOST, f"the server restarted and could not recover it: {exc.message}")
            continue
        if state in (SandboxState.RUNNING, SandboxState.PAUSED, SandboxState.PAUSING, SandboxState.RESUMING):
            # Paused without memory, or a pause/resume that was discarding it: files only.
            stopped = state is not SandboxState.RUNNING and row.pause_mode is SnapshotMode.FILESYSTEM
            if await net.adopt(ctx.runtime, row, spec, stopped):  # with its network policy, or not at all
                # A half-done pause/resume is settled towards the safe side: paused.
                if state in (SandboxState.PAUSING, SandboxState.RESUMING) or stopped:
                    with contextlib.suppress(Exception):
                        row.runtime_state = (await ctx.runtime.pause(row.id, keep_memory=not stopped)).data
                    row.state = SandboxState.PAUSED
                    row.paused_at = row.paused_at or now()
                    row.pause_mode = row.pause_mode or SnapshotMode.FULL
                    ctx.store.update_sandbox(row.id, state=row.state, paused_at=row.paused_at,
                                             pause_mode=row.pause_mode, runtime_state=row.runtime_state)
                ctx.table.add(LiveSandbox(row=row, spec=spec))
                log.info("sandbox=%s recovery: re-adopted (%s)", row.id, row.state)
                continue
            log.warning("sandbox=%s recovery: gone after restart; cleaning up", row.id)
            detail = "its processes did not survive a restart of the server"
        else:
            log.info("sandbox=%s recovery: was %s during the crash; cleaning up", row.id, state.value)
            detail = f"the server stopped while it was {state.value}"
        await ctx.forget(row, KILLED if state is SandboxState.KILLING else LOST, detail)
    reconcile = getattr(ctx.runtime, "reconcile", None)
    if reconcile is not None:
        await reconcile(ctx.table.ids())


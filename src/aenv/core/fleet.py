"""Acting on many sandboxes at once by what they are tagged with: reaping the sandboxes of one RL run.

A trainer that crashes, or an evaluation that is cancelled, leaves hundreds of sandboxes behind; all
it knows about them is the metadata it created them with (``run=<id>``). ``kill_matching`` ends
exactly those: every sandbox whose metadata has all the given pairs, in any state, including one
still starting when the call comes (it is killed as soon as it is up, so a create racing the reap
cannot escape it). Kills run concurrently, a few at a time, so a reap of 500 takes seconds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aenv.core.models import SandboxState
from aenv.core.table import LiveSandbox, SandboxTable
from aenv.errors import AenvError, SandboxNotFound

KILLS_AT_ONCE = 16
START_WAIT = 120.0  # s a still-starting sandbox is waited for before it counts as failed
_POLL = 0.05


@dataclass
class KillReport:
    killed: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (sandbox ID, why)


def matching(table: SandboxTable, metadata: dict[str, str], owner: str | None = None) -> list[LiveSandbox]:
    """Sandboxes (any state but killing) whose metadata holds every pair of ``metadata`` (and, with
    ``owner``, of that team only)."""
    return [
        s for s in table
        if s.state is not SandboxState.KILLING and all(s.row.metadata.get(k) == v for k, v in metadata.items())
        and (owner is None or s.row.owner == owner)
    ]


async def kill_matching(table: SandboxTable, kill: Callable[[str], Awaitable[None]],
                        metadata: dict[str, str], owner: str | None = None) -> KillReport:
    """Kill every sandbox ``matching`` ``metadata``; one that is already gone is simply not listed."""
    report = KillReport()
    gate = asyncio.Semaphore(KILLS_AT_ONCE)

    async def one(sbx: LiveSandbox) -> None:
        async with gate:
            deadline = time.monotonic() + START_WAIT
            while sbx.state is SandboxState.STARTING and sbx.id in table:
                if time.monotonic() > deadline:
                    report.failed.append((sbx.id, f"still starting after {START_WAIT:g} s"))
                    return
                await asyncio.sleep(_POLL)
            if sbx.id not in table:
                return  # its start failed, or someone else killed it
            try:
                await kill(sbx.id)
            except SandboxNotFound:
                return
            except AenvError as exc:
                report.failed.append((sbx.id, exc.message))
                return
            report.killed.append(sbx.id)

    await asyncio.gather(*(one(s) for s in matching(table, metadata, owner)))
    report.killed.sort()
    return report

"""Kills that ride out a gateway restarting: what a rollout started, it ends.

A kill refused by the infrastructure (the gateway restarting: connection refused; a 503) is tried again
until a deadline shared by every kill of one clean-up, so a gateway gone for good costs one budget, not one
per sandbox. A sandbox already gone (404, its node declared dead included) is done: the SDK's ``kill``
returns False for it. Whatever still fails is returned, for the caller's metrics, never raised: a
sandbox that could not be killed ends with its timeout or its lease.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from aenv.rl._outcome import is_infra

KILL_RETRY_S = 30.0


def _retry_in(exc: Exception, delay: float, deadline: float) -> bool:
    return is_infra(exc) and time.monotonic() + delay <= deadline


def kill_until(kill: Callable[[], object], deadline: float) -> str | None:
    """``kill()`` until it went through or ``deadline`` (``time.monotonic``); the last error, or None."""
    delay = 0.2
    while True:
        try:
            kill()
            return None
        except Exception as exc:  # noqa: BLE001 - reported to the caller, never raised
            if not _retry_in(exc, delay, deadline):
                return f"{type(exc).__name__}: {exc}"
        time.sleep(delay)
        delay = min(2.0, delay * 2)


async def akill_until(kill: Callable[[], Awaitable[object]], deadline: float) -> str | None:
    """``kill_until`` on the event loop."""
    delay = 0.2
    while True:
        try:
            await kill()
            return None
        except Exception as exc:  # noqa: BLE001 - reported to the caller, never raised
            if not _retry_in(exc, delay, deadline):
                return f"{type(exc).__name__}: {exc}"
        await asyncio.sleep(delay)
        delay = min(2.0, delay * 2)


def deadline() -> float:
    return time.monotonic() + KILL_RETRY_S

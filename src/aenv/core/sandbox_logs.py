"""A sandbox's log (``GET /sandboxes/{id}/logs``, ``/v2/sandboxes/{id}/logs``): one line per thing the
server did with it — created from which template, paused, resumed, forked from which parent, ended and
why — kept after it ends as long as its tombstone.

Lines are gathered from the orchestrator's events in memory (an append: nothing on the create's path
waits for the database) and written in one transaction about once a second; a read writes what is
pending first, so a client sees its own sandbox's lines at once. A crash loses at most the last
second's lines, never a sandbox's state (that is the sandboxes table's job).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import threading
import time
from typing import Any

from aenv.store.event_log import Event, EventLog
from aenv.store.sqlite import SandboxRow, Store

log = logging.getLogger("aenv.core.sandbox_logs")

FLUSH_EVERY_S = 1.0
MAX_LIMIT = 1000


def _line(event: str, row: SandboxRow, extra: dict[str, str]) -> tuple[str, str]:
    """(level, message) of one lifecycle event."""
    if event == "created":
        return "info", f"sandbox created from template {row.template_id}"
    if event == "forked":
        return "info", f"sandbox forked from {extra.get('parentSandboxId', '?')}"
    if event == "killed":
        reason = extra.get("reason", "killed")
        return ("info" if reason == "killed" else "warn"), f"sandbox ended ({reason}): {extra.get('detail', '')}".rstrip(": ")
    return "info", f"sandbox {event}"


class SandboxLogs:
    def __init__(self, store: Store, retention_s: float) -> None:
        self.events = EventLog(store)
        self.retention_s = retention_s  # as long as tombstones (``gone_retention``)
        self._pending: list[Event] = []
        self._lock = threading.Lock()  # guards _pending: flushes run on worker threads
        self._writing = threading.Lock()  # one batch written at a time, in order
        self._task: asyncio.Task[None] | None = None

    def on_event(self, event: str, row: SandboxRow, extra: dict[str, str]) -> None:
        """An orchestrator event hook: an append, never waits for the database."""
        level, message = _line(event, row, extra)
        with self._lock:
            self._pending.append(Event(row.id, time.time(), level, message, {"event": event, **extra}))

    def flush(self) -> None:
        """Blocking: write what is pending (best effort: a failed write is logged and dropped)."""
        with self._writing:
            with self._lock:
                batch, self._pending = self._pending, []
            try:
                self.events.record_many(batch)
            except Exception as exc:  # noqa: BLE001 - a log line never fails anything else
                log.warning("could not write %d sandbox log lines: %s", len(batch), exc)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="sandbox-logs")

    async def _run(self) -> None:
        rounds = 0
        while True:
            await asyncio.sleep(FLUSH_EVERY_S)
            if self._pending:
                await asyncio.to_thread(self.flush)
            rounds += 1
            if rounds % 600 == 1:  # now and then: lines past their retention
                await asyncio.to_thread(self.prune, time.time() - self.retention_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.to_thread(self.flush)

    def prune(self, before: float) -> int:
        return self.events.prune(before)

    async def page(self, sandbox_id: str, **query: Any) -> list[Event]:
        with self._lock:
            waiting = any(e.sandbox_id == sandbox_id for e in self._pending)
        if waiting:
            await asyncio.to_thread(self.flush)
        return await asyncio.to_thread(lambda: self.events.page(sandbox_id, **query))


def iso(at: float) -> str:
    return dt.datetime.fromtimestamp(at, dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def v1_body(events: list[Event]) -> dict[str, Any]:
    """E2B's ``SandboxLogs``: plain lines and the same as structured entries."""
    return {"logs": [{"timestamp": iso(e.at), "line": e.message} for e in events],
            "logEntries": [entry(e) for e in events]}


def entry(e: Event) -> dict[str, Any]:
    return {"timestamp": iso(e.at), "message": e.message, "level": e.level, "fields": dict(e.fields)}



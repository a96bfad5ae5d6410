"""Each sandbox's log lines (``GET /sandboxes/{id}/logs``): what the server did with it and why.

Rows of ``sandbox_events`` (``sqlite.py``'s schema), written in batches by ``core/sandbox_logs.py``,
read a page at a time from a time on (E2B's cursor), pruned with the tombstones.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from aenv.store.sqlite import Store

LEVELS = ("debug", "info", "warn", "error")  # E2B's LogLevel, lowest first


@dataclass(frozen=True)
class Event:
    sandbox_id: str
    at: float  # wall clock, seconds
    level: str  # one of LEVELS
    message: str
    fields: dict[str, str] = field(default_factory=dict)
    seq: int = 0  # assigned by the store


class EventLog:
    def __init__(self, store: Store) -> None:
        self.store = store

    def record_many(self, events: Iterable[Event]) -> int:
        rows = [(e.sandbox_id, e.at, e.level, e.message, json.dumps(e.fields)) for e in events]
        if not rows:
            return 0
        with self.store._tx() as db:
            db.executemany("INSERT INTO sandbox_events (sandbox_id, at, level, message, fields) VALUES (?, ?, ?, ?, ?)",
                           rows)  # fmt: skip
        return len(rows)

    def page(self, sandbox_id: str, *, limit: int, forward: bool = True, cursor: float | None = None,
             min_level: str = "debug", search: str | None = None) -> list[Event]:
        """Up to ``limit`` lines from ``cursor`` (a wall-clock time, E2B's millisecond cursor ÷ 1000) on:
        oldest first at or after it (``forward``), else newest first at or before it; at ``min_level``
        or above; containing ``search``."""
        where, args = ["sandbox_id = ?"], [sandbox_id]  # type: list[str], list[object]
        if cursor is not None:
            where.append("at >= ?" if forward else "at <= ?")
            args.append(cursor)
        levels = LEVELS[LEVELS.index(min_level):]
        where.append(f"level IN ({','.join('?' * len(levels))})")
        args.extend(levels)
        if search:
            where.append("instr(message, ?) > 0")
            args.append(search)
        order = "ASC" if forward else "DESC"
        rows = self.store._query(
            f"SELECT seq, sandbox_id, at, level, message, fields FROM sandbox_events WHERE {' AND '.join(where)} "
            f"ORDER BY seq {order} LIMIT ?", (*args, limit))  # fmt: skip
        return [Event(r["sandbox_id"], r["at"], r["level"], r["message"], json.loads(r["fields"]), r["seq"])
                for r in rows]  # fmt: skip

    def prune(self, before: float) -> int:
        """Forget lines older than ``before``; returns how many."""
        with self.store._tx() as db:
            return db.execute("DELETE FROM sandbox_events WHERE at < ?", (before,)).rowcount

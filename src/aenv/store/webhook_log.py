"""The webhook delivery log: one row per (event, receiver URL), written before the first attempt, so a
server killed with deliveries in flight sends them after its restart (``core/webhooks.py``).

States: ``pending`` (due at ``next_at``; retried with backoff), ``delivered`` (a 2xx came back), ``failed``
(the attempts ran out). The table is in ``sqlite.py``'s schema (``webhook_deliveries``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aenv.store.sqlite import Store

PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"


@dataclass
class Delivery:
    id: str
    url: str
    event: str
    sandbox_id: str
    body: str
    state: str
    attempts: int
    next_at: float
    created_at: float
    delivered_at: float | None = None
    last_status: int | None = None
    last_error: str | None = None

    def public(self) -> dict[str, Any]:
        """What ``GET /aenv/webhooks/deliveries`` shows (the body is the receiver's business)."""
        return {"id": self.id, "url": self.url, "event": self.event, "sandboxID": self.sandbox_id,
                "state": self.state, "attempts": self.attempts, "nextAttemptAt": self.next_at,
                "createdAt": self.created_at, "deliveredAt": self.delivered_at, "lastStatus": self.last_status,
                "lastError": self.last_error}  # fmt: skip


_COLUMNS = ("id", "url", "event", "sandbox_id", "body", "state", "attempts", "next_at", "created_at",
            "delivered_at", "last_status", "last_error")  # fmt: skip


class DeliveryLog:
    def __init__(self, store: Store) -> None:
        self.store = store

    def add(self, rows: list[Delivery]) -> None:
        with self.store._tx() as db:
            db.executemany(f"INSERT INTO webhook_deliveries ({', '.join(_COLUMNS)}) "
                           f"VALUES ({', '.join('?' * len(_COLUMNS))})",
                           [tuple(getattr(r, c) for c in _COLUMNS) for r in rows])  # fmt: skip

    def due(self, now: float, limit: int) -> list[Delivery]:
        return [Delivery(**dict(r)) for r in self.store._query(
            "SELECT * FROM webhook_deliveries WHERE state = ? AND next_at <= ? ORDER BY next_at LIMIT ?",
            (PENDING, now, limit))]  # fmt: skip

    def next_due(self) -> float | None:
        rows = self.store._query("SELECT MIN(next_at) AS t FROM webhook_deliveries WHERE state = ?", (PENDING,))
        return rows[0]["t"] if rows else None

    def update(self, delivery_id: str, **changes: Any) -> None:
        sets = ", ".join(f"{k} = ?" for k in changes)
        with self.store._tx() as db:
            db.execute(f"UPDATE webhook_deliveries SET {sets} WHERE id = ?", (*changes.values(), delivery_id))

    def list(self, state: str | None = None, limit: int = 100) -> list[Delivery]:
        where, args = ("WHERE state = ?", (state,)) if state else ("", ())
        return [Delivery(**dict(r)) for r in self.store._query(
            f"SELECT * FROM webhook_deliveries {where} ORDER BY created_at DESC LIMIT ?", (*args, limit))]

"""Heartbeat leases (``core/leases.py``): one row per lease, written before its ID is handed out, so a
server restart keeps every lease and the sandboxes bound to it. The table is in ``sqlite.py``'s schema."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aenv.store.sqlite import Store

_COLUMNS = ("id", "owner", "name", "ttl", "expires_at", "created_at", "ended_at", "end_reason")


@dataclass
class LeaseRow:
    id: str
    owner: str  # the API key's owner (sha256 of the key, '' without auth): only it may heartbeat or end it
    name: str
    ttl: float
    expires_at: float
    created_at: float
    ended_at: float | None = None
    end_reason: str | None = None  # expired | ended

    @property
    def live(self) -> bool:
        return self.ended_at is None


class LeaseLog:
    def __init__(self, store: Store) -> None:
        self.store = store

    def put(self, row: LeaseRow) -> None:
        with self.store._tx() as db:
            db.execute(f"INSERT INTO leases ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})",
                       tuple(getattr(row, c) for c in _COLUMNS))  # fmt: skip

    def update(self, lease_id: str, **changes: Any) -> None:
        if not changes:
            return
        sets = ", ".join(f"{k} = ?" for k in changes)
        with self.store._tx() as db:
            db.execute(f"UPDATE leases SET {sets} WHERE id = ?", (*changes.values(), lease_id))

    def get(self, lease_id: str) -> LeaseRow | None:
        rows = self.store._query("SELECT * FROM leases WHERE id = ?", (lease_id,))
        return LeaseRow(**dict(rows[0])) if rows else None

    def due(self, at: float) -> list[LeaseRow]:
        """Live leases whose heartbeat is overdue at ``at``."""
        return [LeaseRow(**dict(r)) for r in self.store._query(
            "SELECT * FROM leases WHERE ended_at IS NULL AND expires_at <= ?", (at,))]

    def live(self) -> list[LeaseRow]:
        return [LeaseRow(**dict(r)) for r in self.store._query("SELECT * FROM leases WHERE ended_at IS NULL")]

    def of_owner(self, owner: str | None, limit: int) -> list[LeaseRow]:
        """The owner's leases, live ones first, then the most recently ended."""
        where, args = ("WHERE owner = ? ", (owner,)) if owner is not None else ("", ())
        return [LeaseRow(**dict(r)) for r in self.store._query(
            f"SELECT * FROM leases {where}ORDER BY ended_at IS NOT NULL, COALESCE(ended_at, created_at) DESC "
            "LIMIT ?", (*args, limit))]  # fmt: skip

    def prune(self, before: float) -> int:
        with self.store._tx() as db:
            return db.execute("DELETE FROM leases WHERE ended_at IS NOT NULL AND ended_at < ?", (before,)).rowcount

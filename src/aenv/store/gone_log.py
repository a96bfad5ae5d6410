"""Tombstones: which sandboxes ended, when and why, so a late request about one hears the reason.

An RL trainer that finds its rollout's sandbox missing has to decide whether the rollout failed or the
infrastructure did: "not found" alone cannot tell a typo from a sandbox the TTL ended, a reap by
metadata, a lost heartbeat lease or a server restart that lost it. Each end with a reason writes one
row here (the first reason wins: a crash between the tombstone and the row's delete must not turn a
kill into "lost"); rows older than the retention are pruned by the reaper. The table is in
``sqlite.py``'s schema (``gone_sandboxes``).
"""

from __future__ import annotations

from dataclasses import dataclass

from aenv.store.sqlite import Store

KILLED, EXPIRED, REAPED, LEASE_EXPIRED, LEASE_ENDED, LOST = (
    "killed", "expired", "reaped", "lease_expired", "lease_ended", "lost")  # fmt: skip
REASONS = (KILLED, EXPIRED, REAPED, LEASE_EXPIRED, LEASE_ENDED, LOST)


@dataclass(frozen=True)
class Gone:
    sandbox_id: str
    reason: str  # one of REASONS
    detail: str  # a sentence for people ("killed by metadata run=r7", "server restarted while it was starting")
    at: float
    owner: str = ""  # the team of the sandbox: another team hears "not found"


class GoneLog:
    def __init__(self, store: Store) -> None:
        self.store = store

    def record(self, sandbox_id: str, reason: str, detail: str, at: float, owner: str = "") -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown end reason {reason!r}")
        with self.store._tx() as db:
            db.execute("INSERT OR IGNORE INTO gone_sandboxes (id, reason, detail, at, owner) VALUES (?, ?, ?, ?, ?)",
                       (sandbox_id, reason, detail, at, owner))  # fmt: skip

    def find(self, sandbox_id: str) -> Gone | None:
        rows = self.store._query("SELECT id, reason, detail, at, owner FROM gone_sandboxes WHERE id = ?", (sandbox_id,))
        if not rows:
            return None
        r = rows[0]
        return Gone(r["id"], r["reason"], r["detail"], r["at"], r["owner"])

    def prune(self, before: float) -> int:
        """Forget tombstones older than ``before``; returns how many."""
        with self.store._tx() as db:
            return db.execute("DELETE FROM gone_sandboxes WHERE at < ?", (before,)).rowcount

"""Heartbeat leases: a client that stops heartbeating loses its sandboxes, within seconds, by itself.

A trainer holding 2,000 rollout sandboxes should not have to refresh 2,000 TTLs to stay alive, and a
trainer that crashes should not leave them running until each TTL runs out. It takes one lease
(``POST /aenv/leases {"ttl": 30}``), tags each sandbox with it (metadata ``aenv.lease=<id>``; forks
inherit the tag), and heartbeats the lease alone (``POST /aenv/leases/{id}/heartbeat``). When ``ttl``
seconds pass without a heartbeat, the lease ends and every sandbox bound to it is killed (their
tombstones say ``lease_expired``); ``DELETE`` ends it on purpose (``lease_ended``). Sandbox TTLs
still apply on their own.

Leases are rows in the store: a restart of the server keeps them, and gives each live lease a full
``ttl`` from the restart (its client could not heartbeat a server that was down). A create that names
an ended or unknown lease is refused; one that raced the lease's end (checked, then the lease ended
before its sandbox was in the table) is killed as soon as it is created.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

from aenv.config import Settings
from aenv.core.fleet import KillReport
from aenv.core.ids import new_id
from aenv.errors import Conflict, Gone, InvalidRequest, NotFound
from aenv.store.gone_log import LEASE_ENDED, LEASE_EXPIRED
from aenv.store.leases import LeaseLog, LeaseRow
from aenv.store.sqlite import SandboxRow, Store, now

log = logging.getLogger("aenv.core")

LEASE_KEY = "aenv.lease"  # the metadata key that binds a sandbox to a lease
LEASE_ID = re.compile(r"[a-z][a-z0-9]{7,39}")  # a lease id a gateway may choose
MIN_TTL = 1.0
LIST_LIMIT = 1000
RETENTION = 86400.0  # s an ended lease is still listed (and answers 410 rather than 404)
PRUNE_EVERY = 600.0  # s between removals of leases past RETENTION

KillMatching = Callable[[dict[str, str], str, str], Awaitable[KillReport]]


class LeaseNotFound(NotFound):
    def __init__(self, lease_id: str) -> None:
        super().__init__(f"lease '{lease_id}' not found", lease_id=lease_id)


class LeaseUnknown(InvalidRequest):
    """A create names a lease this node does not hold: ``reason`` tells a gateway to try another node
    (a node that was down when the lease was made does not hold it)."""

    reason = "lease_unknown"

    def __init__(self, lease_id: str) -> None:
        super().__init__(f"metadata {LEASE_KEY}: no lease '{lease_id}' (create one: POST /aenv/leases)",
                         lease_id=lease_id)  # fmt: skip


class LeaseEnded(Gone):
    def __init__(self, row: LeaseRow) -> None:
        why = f"no heartbeat for {row.ttl:g} s" if row.end_reason == "expired" else "ended by its client"
        super().__init__(f"lease '{row.id}' ended ({why}); the sandboxes bound to it were killed", lease_id=row.id)


class Leases:
    def __init__(self, settings: Settings, store: Store, kill_matching: KillMatching) -> None:
        self.settings = settings
        self.log = LeaseLog(store)
        self._kill_matching = kill_matching
        self._task: asyncio.Task[None] | None = None
        self._reaps: set[asyncio.Future[Any]] = set()
        self._pruned_at = float("-inf")

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Give every lease that survived a restart a full ``ttl`` from now, then watch for expiries."""
        t = now()
        for row in self.log.live():
            if row.expires_at < t + row.ttl:
                self.log.update(row.id, expires_at=t + row.ttl)
        self._task = asyncio.create_task(self._watch(), name="aenv-leases")

    async def close(self) -> None:
        for task in (self._task, *self._reaps):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    # ---- the API's operations -------------------------------------------------------------------
    def create(self, owner: str, ttl: float, name: str = "", lease_id: str | None = None) -> LeaseRow:
        """A new lease; ``lease_id`` is given by a gateway, which makes the same lease on every node."""
        if not MIN_TTL <= ttl <= self.settings.max_timeout:
            raise InvalidRequest(f"ttl: between {MIN_TTL:g} and {self.settings.max_timeout} seconds")
        if lease_id is not None:
            if not LEASE_ID.fullmatch(lease_id):
                raise InvalidRequest(f"lease id {lease_id!r}: 8-40 lowercase letters and digits, a letter first")
            if self.log.get(lease_id) is not None:
                raise Conflict(f"lease '{lease_id}' exists", lease_id=lease_id)
        t = now()
        row = LeaseRow(id=lease_id or new_id(), owner=owner, name=name, ttl=ttl, expires_at=t + ttl, created_at=t)
        self.log.put(row)
        log.info("lease=%s created ttl=%gs name=%s", row.id, ttl, name or "-")
        return row

    def get(self, lease_id: str, owner: str | None) -> LeaseRow:
        """``owner``'s lease (None: anyone's, for an admin)."""
        row = self.log.get(lease_id)
        if row is None or (owner is not None and row.owner != owner):  # another team's lease does not exist, for this one
            raise LeaseNotFound(lease_id)
        return row

    def heartbeat(self, lease_id: str, owner: str | None) -> LeaseRow:
        row = self.get(lease_id, owner)
        if not row.live:
            raise LeaseEnded(row)
        row.expires_at = now() + row.ttl
        self.log.update(row.id, expires_at=row.expires_at)
        return row

    async def end(self, lease_id: str, owner: str | None) -> tuple[LeaseRow, KillReport]:
        row = self.get(lease_id, owner)
        if not row.live:
            raise LeaseEnded(row)
        return row, await self._end(row, "ended")

    def listing(self, owner: str | None) -> list[LeaseRow]:
        return self.log.of_owner(owner, LIST_LIMIT)  # None: every team's

    def check_binding(self, metadata: dict[str, str], owner: str) -> None:
        """A create that names a lease: it must be this key's, and live (400 / 410 otherwise)."""
        lease_id = metadata.get(LEASE_KEY)
        if lease_id is None:
            return
        row = self.log.get(lease_id)
        if row is None or row.owner != owner:
            raise LeaseUnknown(lease_id)
        if not row.live:
            raise LeaseEnded(row)

    # ---- hooks and the watcher ------------------------------------------------------------------
    def on_event(self, event: str, row: SandboxRow, extra: dict[str, str]) -> None:
        """An orchestrator event hook: a sandbox created (or forked) under a lease that has meanwhile
        ended is killed at once, so a create racing the lease's end cannot outlive it."""
        lease_id = row.metadata.get(LEASE_KEY)
        if event not in ("created", "forked") or lease_id is None:
            return
        lease = self.log.get(lease_id)
        if lease is not None and not lease.live:
            self._spawn(self._kill_matching({LEASE_KEY: lease_id}, _reason(lease), _detail(lease)))

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reaper_interval)
            try:
                await self.expire_due(now())
            except Exception:  # noqa: BLE001 - the watcher must outlive one bad round
                log.exception("lease watcher round failed")

    async def expire_due(self, at: float) -> list[str]:
        """End every live lease whose heartbeat is overdue at ``at`` and kill its sandboxes. Returns
        the ended lease IDs (the loop passes the wall clock; tests pass any time they like)."""
        ended = []
        for row in self.log.due(at):
            await self._end(row, "expired")
            ended.append(row.id)
        if at - self._pruned_at >= PRUNE_EVERY:
            self.log.prune(at - RETENTION)
            self._pruned_at = at
        return ended

    async def _end(self, row: LeaseRow, reason: str) -> KillReport:
        row.ended_at, row.end_reason = now(), reason
        self.log.update(row.id, ended_at=row.ended_at, end_reason=reason)  # first: no new create binds to it
        report = await self._kill_matching({LEASE_KEY: row.id}, _reason(row), _detail(row))
        log.info("lease=%s %s; killed %d sandboxes (%d failed)", row.id, reason, len(report.killed), len(report.failed))
        return report

    def _spawn(self, work: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(work)
        self._reaps.add(task)
        task.add_done_callback(self._reaps.discard)


def _reason(row: LeaseRow) -> str:
    return LEASE_EXPIRED if row.end_reason == "expired" else LEASE_ENDED


def _detail(row: LeaseRow) -> str:
    if row.end_reason == "expired":
        return f"lease {row.id} got no heartbeat for {row.ttl:g} s"
    return f"lease {row.id} was ended by its client"


def public(row: LeaseRow, bound: int) -> dict[str, Any]:
    """What the lease routes answer."""
    return {"leaseID": row.id, "name": row.name, "ttl": row.ttl, "expiresAt": row.expires_at,
            "createdAt": row.created_at, "state": "live" if row.live else "ended", "endedAt": row.ended_at,
            "endReason": row.end_reason, "sandboxes": bound}  # fmt: skip

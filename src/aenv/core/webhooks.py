"""Lifecycle webhooks: a trainer learns that its sandboxes were created, paused, resumed, forked or
killed (expired ones included) without polling the list.

Every event becomes one delivery per receiver (``webhook_urls``), written to the store's delivery log
*before* it is sent (``store/webhook_log.py``): a server killed with ``kill -9`` sends what was pending
after its restart, so nothing is lost (a receiver may see an event twice; the ``id`` field is the
delivery's, for de-duplication). A delivery is a POST of JSON, signed when ``webhook_secret`` is set::

    X-Aenv-Timestamp: <unix seconds>
    X-Aenv-Signature: sha256=<hex HMAC-SHA256(secret, "<timestamp>." + body)>

The receiver recomputes the HMAC over the timestamp and the raw body (and may refuse old timestamps:
a replayed request carries the old one). A non-2xx answer or a transport error is retried with
exponential backoff (``webhook_backoff``, doubling, at most 5 min apart) up to ``webhook_attempts``
tries, then the delivery is ``failed`` in the log (``GET /aenv/webhooks/deliveries``).

The orchestrator only calls ``emit`` from its event hooks (``Orchestrator.on_event``); ``emit`` writes
the rows and wakes the sender, which never blocks a sandbox's lifecycle.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hashlib
import hmac
import json
import logging
import secrets
import time
from typing import Any

import httpx

from aenv.config import Settings
from aenv.store.sqlite import SandboxRow, Store
from aenv.store.webhook_log import DELIVERED, FAILED, Delivery, DeliveryLog

log = logging.getLogger("aenv.webhooks")

EVENTS = ("created", "paused", "resumed", "forked", "killed")
MAX_DELAY = 300.0
BATCH = 32
IDLE_WAIT = 30.0


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """``sha256=<hex>`` over ``"<timestamp>." + body``: what the receiver recomputes."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


def verify(secret: str, timestamp: str, body: bytes, signature: str) -> bool:
    """The receiver's check (constant time), for tests and for users' receivers written in Python."""
    return hmac.compare_digest(sign(secret, int(timestamp), body), signature)


def backoff(base: float, attempts: int) -> float:
    return float(min(MAX_DELAY, base * 2 ** max(0, attempts - 1)))


def event_body(delivery_id: str, event: str, row: SandboxRow, extra: dict[str, str]) -> str:
    """E2B's lifecycle event shape (type sandbox.lifecycle.<event>) with the sandbox's template and metadata."""
    return json.dumps({
        "id": delivery_id, "type": f"sandbox.lifecycle.{event}", "sandboxId": row.id,
        "sandboxTemplateId": row.template_id, "sandboxMetadata": dict(row.metadata),
        "timestamp": dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z"), "eventData": dict(extra),
    }, separators=(",", ":"))  # fmt: skip


class Webhooks:
    def __init__(self, settings: Settings, store: Store) -> None:
        self.urls = list(settings.webhook_urls)
        self.secret = settings.webhook_secret
        self.attempts = settings.webhook_attempts
        self.base = settings.webhook_backoff
        self.log = DeliveryLog(store)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._client: httpx.AsyncClient | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.urls)

    def emit(self, event: str, row: SandboxRow, extra: dict[str, str] | None = None) -> None:
        """Orchestrator.on_event hook: log one delivery per receiver (durably) and wake the sender."""
        if not self.urls:
            return
        t = time.time()
        rows = []
        for url in self.urls:
            did = "wh_" + secrets.token_hex(12)
            rows.append(Delivery(did, url, event, row.id, event_body(did, event, row, extra or {}), "pending", 0, t, t))
        self.log.add(rows)
        self._wake.set()

    async def start(self) -> None:
        """Start sending, first whatever a previous process left pending."""
        if self.urls and self._task is None:
            self._client = httpx.AsyncClient(timeout=10.0, trust_env=False)
            self._task = asyncio.create_task(self._run(), name="aenv-webhooks")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            due = await asyncio.to_thread(self.log.due, time.time(), BATCH)
            if due:
                await asyncio.gather(*(self._deliver(d) for d in due))
                continue
            nxt = await asyncio.to_thread(self.log.next_due)
            wait = IDLE_WAIT if nxt is None else max(0.0, min(IDLE_WAIT, nxt - time.time()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)

    async def _deliver(self, d: Delivery) -> None:
        assert self._client is not None
        body = d.body.encode()
        ts = int(time.time())
        headers = {"Content-Type": "application/json", "X-Aenv-Timestamp": str(ts),
                   "X-Aenv-Event": d.event, "X-Aenv-Delivery": d.id}  # fmt: skip
        if self.secret:
            headers["X-Aenv-Signature"] = sign(self.secret, ts, body)
        status: int | None = None
        error: str | None = None
        try:
            resp = await self._client.post(d.url, content=body, headers=headers)
            status = resp.status_code
            if 200 <= status < 300:
                self.log.update(d.id, state=DELIVERED, attempts=d.attempts + 1, delivered_at=time.time(),
                                last_status=status, last_error=None)
                return
            error = f"HTTP {status}"
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"
        attempts = d.attempts + 1
        if attempts >= self.attempts:
            log.warning("webhook %s to %s failed after %d attempts: %s", d.id, d.url, attempts, error)
            self.log.update(d.id, state=FAILED, attempts=attempts, last_status=status, last_error=error)
        else:
            self.log.update(d.id, attempts=attempts, next_at=time.time() + backoff(self.base, attempts),
                            last_status=status, last_error=error)

    def deliveries(self, state: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        return [d.public() for d in self.log.list(state, limit)]


__all__ = ["EVENTS", "Webhooks", "backoff", "sign", "verify"]

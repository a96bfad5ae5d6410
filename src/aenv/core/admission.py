"""Admission of creates: a burst waits its turn instead of failing.

An RL trainer asks for a few hundred sandboxes at the same instant; the node can start only
``max_concurrent_starts`` at once. Creates past that wait here, in a bounded queue that is fair
across groups, a group being one API key and one run (the ``admission_group_key`` metadata value,
``run`` by default): when a start slot frees, the next group in turn gets it, so one run's burst
of 500 cannot starve another run's 5. Past the bounds the answer is a readable refusal with a
reason a client can act on:

- ``capacity``: the queue is full (``admission_queue``), a create waited ``admission_wait``
  seconds without a slot, or the node holds ``max_sandboxes`` already;
- ``quota``: the API key holds its ``key_quotas`` / ``default_key_quota`` of live and starting
  sandboxes (waiting would not help: only a kill frees quota).

Who owns which sandbox is kept here in memory (a restart forgets it: recovered sandboxes count for
nobody's quota until they end).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable

from aenv.config import Settings
from aenv.core.table import SandboxTable
from aenv.errors import CapacityError

Group = tuple[str, str]  # (owner, run tag)


def owner_of(api_key: str | None) -> str:
    """The quota owner of a presented key: its sha256 hex digest ('' when no key was given)."""
    return hashlib.sha256(api_key.encode()).hexdigest() if api_key else ""


class Admission:
    def __init__(self, settings: Settings, table: SandboxTable) -> None:
        self.settings = settings
        self.table = table
        self.starting = 0
        self._queues: OrderedDict[Group, deque[asyncio.Future[None]]] = OrderedDict()
        self._waiting = 0
        self._owned: dict[str, set[str]] = {}
        self.on_refused: Callable[[str | None, str], None] | None = None  # (run, reason), e.g. run_metrics.py
        self._pending: dict[str, int] = {}  # owner -> creates admitted or waiting, not yet in _owned
        self._quotas = {self._owner_key(k): v for k, v in settings.key_quotas.items()}

    @staticmethod
    def _owner_key(configured: str) -> str:
        return configured[len("sha256:"):] if configured.startswith("sha256:") else owner_of(configured)

    # ---- what callers see -----------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return self._waiting

    def live_for(self, owner: str) -> int:
        ids = self._owned.get(owner)
        if not ids:
            return 0
        ids &= self.table.ids()  # sandboxes that ended since are no one's any more
        return len(ids)

    def quota_for(self, owner: str) -> int | None:
        return self._quotas.get(owner, self.settings.default_key_quota)

    @contextlib.asynccontextmanager
    async def slot(self, owner: str, run: str | None) -> AsyncIterator[None]:
        """Hold a start slot for one create (waiting fairly for it), or raise CapacityError."""
        try:
            self._check_quota(owner)
            self._check_total()
        except CapacityError as exc:
            self._refused(run, exc)
            raise
        self._pending[owner] = self._pending.get(owner, 0) + 1
        try:
            try:
                await self._acquire((owner, run or ""))
            except CapacityError as exc:
                self._refused(run, exc)
                raise
            try:
                self._check_total()  # the node may have filled up while it waited
                yield
            finally:
                self._release()
        finally:
            self._pending[owner] -= 1
            if not self._pending[owner]:
                del self._pending[owner]

    def _refused(self, run: str | None, exc: CapacityError) -> None:
        if self.on_refused is not None:
            self.on_refused(run, exc.reason)

    def owns(self, owner: str, sandbox_id: str) -> None:
        """``sandbox_id`` (just created) counts for ``owner``'s quota while it lives."""
        self._owned.setdefault(owner, set()).add(sandbox_id)

    # ---- the rules ------------------------------------------------------------------------------
    def _check_quota(self, owner: str) -> None:
        quota = self.quota_for(owner)
        if quota is None:
            return
        held = self.live_for(owner) + self._pending.get(owner, 0)
        if held >= quota:
            raise CapacityError(
                f"API key quota reached: {held} sandboxes live or starting, the quota is {quota}; "
                "kill some first", retry_after=5, reason="quota")

    def _check_total(self) -> None:
        if len(self.table) >= self.settings.max_sandboxes:
            raise CapacityError(f"sandbox limit of {self.settings.max_sandboxes} reached", retry_after=5,
                                reason="capacity")

    async def _acquire(self, group: Group) -> None:
        if self.starting < self.settings.max_concurrent_starts and not self._waiting:
            self.starting += 1
            return
        if self._waiting >= self.settings.admission_queue:
            raise CapacityError(
                f"{self.starting} sandboxes starting and {self._waiting} waiting (the queue holds "
                f"{self.settings.admission_queue}); retry later", retry_after=self._retry_hint(), reason="capacity")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queues.setdefault(group, deque()).append(fut)
        self._waiting += 1
        started = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.settings.admission_wait)
        except TimeoutError:
            if fut.done() and not fut.cancelled():  # the slot came just as the wait ended: take it
                return
            self._drop(group, fut)
            raise CapacityError(
                f"waited {time.monotonic() - started:.0f} s for a start slot ({self.starting} starting, "
                f"{self._waiting} waiting); retry later", retry_after=self._retry_hint(), reason="capacity",
            ) from None
        except BaseException:
            if fut.done() and not fut.cancelled():
                self._release()  # it was handed a slot it will not use
            else:
                self._drop(group, fut)
            raise

    def _drop(self, group: Group, fut: asyncio.Future[None]) -> None:
        queue = self._queues.get(group)
        if queue is not None and fut in queue:
            queue.remove(fut)
            self._waiting -= 1
            if not queue:
                del self._queues[group]
        fut.cancel()

    def _release(self) -> None:
        """A start ended: its slot goes to the first waiter of the next group in turn."""
        while self._queues:
            group, queue = next(iter(self._queues.items()))
            fut = queue.popleft()
            self._waiting -= 1
            if queue:
                self._queues.move_to_end(group)  # round robin: this group goes last
            else:
                del self._queues[group]
            if not fut.done():
                fut.set_result(None)  # the slot passes on: ``starting`` stays the same
                return
        self.starting -= 1

    def _retry_hint(self) -> float:
        """Seconds until a retry might be admitted: the queue ahead of it, at about one start per second a slot."""
        return max(1.0, min(30.0, self._waiting / max(1, self.settings.max_concurrent_starts)))

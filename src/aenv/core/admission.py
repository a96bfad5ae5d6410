"""Admission of creates: a burst waits its turn instead of failing, and each team stays within its quota.

An RL trainer asks for a few hundred sandboxes at the same instant; the node can start only
``max_concurrent_starts`` at once. Creates past that wait here, in a bounded queue that is fair at two
levels: between teams first (``aenv/teams.py``), then between the runs of a team (the
``admission_group_key`` metadata value, ``run`` by default). When a start slot frees, the next team in
turn gets it, and within that team its next run: one team's burst of 500 cannot starve another team's 5,
nor one run another run of the same team. Past the bounds the answer is a readable refusal:

- ``capacity`` (429): the queue is full (``admission_queue``), a create waited ``admission_wait``
  seconds without a slot, or the node holds ``max_sandboxes`` already;
- ``quota`` (429, with ``quota`` and ``limit`` naming which): the team holds its ``max_sandboxes``,
  ``max_vcpus`` or ``max_memory_mb`` (paused sandboxes count: they may resume at any moment), or it
  creates faster than ``creates_per_second``; a 403 when the request alone is over a limit.

What a team holds is read from the sandbox table (every row records its team), so it is right after a
restart too. The check is made twice: before a create queues (a quick refusal) and again by the
orchestrator right before the sandbox's row enters the table, with no await in between, so concurrent
creates cannot together pass a limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from aenv.config import Settings
from aenv.core.table import SandboxTable
from aenv.errors import CapacityError, QuotaExceeded
from aenv.teams import Quota, label


@dataclass
class Usage:
    """What a team holds on this node."""

    sandboxes: int = 0
    vcpus: int = 0
    memory_mb: int = 0


class _Bucket:
    """A token bucket: ``rate`` creates a second, a burst of one second's worth."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.tokens = max(1.0, rate)
        self.at = time.monotonic()

    def take(self) -> float:
        """0 when a create may go now, else the seconds until it could."""
        t = time.monotonic()
        self.tokens = min(max(1.0, self.rate), self.tokens + (t - self.at) * self.rate)
        self.at = t
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class Admission:
    def __init__(self, settings: Settings, table: SandboxTable) -> None:
        self.settings = settings
        self.table = table
        self.teams = settings.team_directory()
        self.starting = 0
        # team -> its runs in turn -> waiters: two levels of round robin
        self._queues: OrderedDict[str, OrderedDict[str, deque[asyncio.Future[None]]]] = OrderedDict()
        self._waiting = 0
        self._buckets: dict[str, _Bucket] = {}
        self._starting_by_team: dict[str, int] = {}  # start slots each team holds
        self.on_refused: Callable[[str, str | None, str], None] | None = None  # (team, run, reason): run_metrics.py
        self.refusals: dict[tuple[str, str], int] = {}  # (team, quota) -> refusals, for /metrics
        # Called with True when a team's burst should yield the CPU (``contended``), False when it need
        # not any more: the runtime weighs the burst's starts down meanwhile (runtime.base.BurstYielding).
        self.on_contention: Callable[[bool], None] | None = None
        self._contended = False

    # ---- what callers see -----------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return self._waiting

    def usage(self, owner: str) -> Usage:
        used = Usage()
        for s in self.table:
            if s.row.owner == owner:
                used.sandboxes += 1
                used.vcpus += s.row.cpu_count
                used.memory_mb += s.row.memory_mb
        return used

    def usage_by_team(self) -> dict[str, Usage]:
        out: dict[str, Usage] = {}
        for s in self.table:
            used = out.setdefault(s.row.owner, Usage())
            used.sandboxes += 1
            used.vcpus += s.row.cpu_count
            used.memory_mb += s.row.memory_mb
        return out

    def quota(self, owner: str) -> Quota:
        return self.teams.quota(owner)

    def live_for(self, owner: str) -> int:
        return self.usage(owner).sandboxes

    def quota_for(self, owner: str) -> int | None:
        return self.quota(owner).max_sandboxes

    @contextlib.asynccontextmanager
    async def slot(self, owner: str, run: str | None, vcpus: int = 0, memory_mb: int = 0) -> AsyncIterator[None]:
        """Hold a start slot for one create (waiting fairly for it), or raise CapacityError."""
        try:
            self.check_quota(owner, 1, vcpus, memory_mb)
            self._check_rate(owner)
            self._check_total()
        except CapacityError as exc:
            self._refused(owner, run, exc)
            raise
        try:
            await self._acquire(owner, run or "")
        except CapacityError as exc:
            self._refused(owner, run, exc)
            raise
        try:
            self._check_total()  # the node may have filled up while it waited
            yield
        finally:
            self._release(owner)

    def _refused(self, owner: str, run: str | None, exc: CapacityError) -> None:
        if self.on_refused is not None:
            self.on_refused(owner, run, exc.reason)

    # ---- the rules ------------------------------------------------------------------------------
    def check_quota(self, owner: str, sandboxes: int, vcpus: int, memory_mb: int) -> None:
        """Refuse (QuotaExceeded) when ``owner``'s team would hold more than its quota with ``sandboxes``
        more sandboxes of ``vcpus`` and ``memory_mb`` in all. Synchronous: callers add the sandboxes to
        the table before they next await."""
        quota = self.quota(owner)
        if quota.max_sandboxes is None and quota.max_vcpus is None and quota.max_memory_mb is None:
            return
        used = self.usage(owner)
        for name, limit, held, asked, unit in (
            ("max_sandboxes", quota.max_sandboxes, used.sandboxes, sandboxes, "sandboxes"),
            ("max_vcpus", quota.max_vcpus, used.vcpus, vcpus, "vCPUs"),
            ("max_memory_mb", quota.max_memory_mb, used.memory_mb, memory_mb, "MiB of memory"),
        ):
            if limit is None or held + asked <= limit:
                continue
            self.refusals[(owner, name)] = self.refusals.get((owner, name), 0) + 1
            if asked > limit:
                raise QuotaExceeded(f"team quota {name} = {limit}: this request alone asks for {asked} {unit}",
                                    name, limit, hard=True)
            raise QuotaExceeded(f"team quota {name} = {limit} reached: the team holds {held} {unit} and this "
                                f"request asks for {asked} more; kill or pause-to-disk some first", name, limit)

    def _check_rate(self, owner: str) -> None:
        rate = self.quota(owner).creates_per_second
        if rate is None:
            return
        bucket = self._buckets.get(owner)
        if bucket is None or bucket.rate != rate:
            bucket = self._buckets[owner] = _Bucket(rate)
        wait = bucket.take()
        if wait > 0:
            self.refusals[(owner, "creates_per_second")] = self.refusals.get((owner, "creates_per_second"), 0) + 1
            raise QuotaExceeded(f"team quota creates_per_second = {rate:g} reached ({label(owner)}); retry in "
                                f"{wait:.1f} s", "creates_per_second", rate, retry_after=wait)

    def _check_total(self) -> None:
        if len(self.table) >= self.settings.max_sandboxes:
            raise CapacityError(f"sandbox limit of {self.settings.max_sandboxes} reached", retry_after=5,
                                reason="capacity")

    @property
    def team_cap(self) -> int:
        """Start slots one team may hold at once: all of them on a server of one team; with several,
        ``team_concurrent_starts`` (2 per CPU by default), so that another team's create finds a slot
        free and competes for the CPU with a few of a burst's starts, not with all of them. A start is
        CPU-bound: a burst is served as fast with 4 at once as with 24 on 2 cores (``bench/teams.py``)."""
        slots = self.settings.max_concurrent_starts
        if len(self.teams.teams()) < 2:
            return slots
        per_team = self.settings.team_concurrent_starts or 2 * (os.cpu_count() or 1)
        return max(1, min(slots - 1, per_team)) if slots > 1 else 1

    def in_burst(self, team: str) -> bool:
        """Whether a create of ``team`` is one of a burst on a server of several teams (the team has other
        starts in flight): it then starts fresh, so the few pooled sandboxes go to the other teams' creates
        (a burst gains little from them; a lone create of another team would otherwise pay a full start on
        a host the burst keeps busy). Its restores give way only while another team creates
        (``contended``): at a low CPU weight throughout, the burst of 200 took 19.5 s instead of 12.2."""
        return len(self.teams.teams()) >= 2 and self._starting_by_team.get(team, 0) > 1

    def contended(self) -> bool:
        """Whether a burst should give way now: on a server of several teams, a team holds more than one
        start slot while another team has a create in flight (holding a slot or waiting for one). Only
        then do the burst's starts run at a low CPU weight: at a low weight throughout, a burst of 200
        took 19.5 s instead of 12.2 (``in_burst``); this way it gives way for the other team's few
        creates only, and the lone creates of a team are never weighed down."""
        if len(self.teams.teams()) < 2:
            return False
        bursting = {t for t, n in self._starting_by_team.items() if n > 1}
        return bool(bursting) and any(t not in bursting for t in (*self._starting_by_team, *self._queues))

    def _contention_changed(self) -> None:
        now = self.contended()
        if now != self._contended:
            self._contended = now
            if self.on_contention is not None:
                self.on_contention(now)

    def _eligible(self, team: str) -> bool:
        return self._starting_by_team.get(team, 0) < self.team_cap

    def _take(self, team: str) -> None:
        self._starting_by_team[team] = self._starting_by_team.get(team, 0) + 1
        self._contention_changed()

    async def _acquire(self, team: str, run: str) -> None:
        waiters_first = any(self._eligible(t) for t in self._queues)  # served in turn before a newcomer
        if self.starting < self.settings.max_concurrent_starts and self._eligible(team) and not waiters_first:
            self.starting += 1
            self._take(team)
            return
        if self._waiting >= self.settings.admission_queue:
            raise CapacityError(
                f"{self.starting} sandboxes starting and {self._waiting} waiting (the queue holds "
                f"{self.settings.admission_queue}); retry later", retry_after=self._retry_hint(), reason="capacity")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queues.setdefault(team, OrderedDict()).setdefault(run, deque()).append(fut)
        self._waiting += 1
        self._contention_changed()
        started = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.settings.admission_wait)
        except TimeoutError:
            if fut.done() and not fut.cancelled():  # the slot came just as the wait ended: take it
                return
            self._drop(team, run, fut)
            raise CapacityError(
                f"waited {time.monotonic() - started:.0f} s for a start slot ({self.starting} starting, "
                f"{self._waiting} waiting); retry later", retry_after=self._retry_hint(), reason="capacity",
            ) from None
        except BaseException:
            if fut.done() and not fut.cancelled():
                self._release(team)  # it was handed a slot it will not use
            else:
                self._drop(team, run, fut)
            raise

    def _drop(self, team: str, run: str, fut: asyncio.Future[None]) -> None:
        runs = self._queues.get(team)
        queue = runs.get(run) if runs is not None else None
        if runs is not None and queue is not None and fut in queue:
            queue.remove(fut)
            self._waiting -= 1
            if not queue:
                del runs[run]
            if not runs:
                del self._queues[team]
            self._contention_changed()
        fut.cancel()

    def _release(self, team: str) -> None:
        """A start of ``team`` ended: its slot goes to the first waiter of the next team in turn that is
        under its cap, of that team's next run."""
        self._starting_by_team[team] -= 1
        if not self._starting_by_team[team]:
            del self._starting_by_team[team]
        while (nxt := next((t for t in self._queues if self._eligible(t)), None)) is not None:
            runs = self._queues[nxt]
            run, queue = next(iter(runs.items()))
            fut = queue.popleft()
            self._waiting -= 1
            if queue:
                runs.move_to_end(run)  # round robin within the team: this run goes last
            else:
                del runs[run]
            if runs:
                self._queues.move_to_end(nxt)  # and between teams: this team goes last
            else:
                del self._queues[nxt]
            if not fut.done():
                self._take(nxt)
                fut.set_result(None)  # the slot passes on: ``starting`` stays the same
                return
        self.starting -= 1
        self._contention_changed()

    def _retry_hint(self) -> float:
        """Seconds until a retry might be admitted: the queue ahead of it, at about one start per second a slot."""
        return max(1.0, min(30.0, self._waiting / max(1, self.settings.max_concurrent_starts)))

"""The live-sandbox table: one in-memory entry per sandbox the store knows, shared by every core flow.

Lifecycle flows (``orchestrator.py``) and checkpoint flows (``snapshots.py``) both add, look up and
drop sandboxes; they do it only through this table, so its rules hold in one place: an entry exists
from the moment its row is written until the row is deleted, ``get`` shows only what E2B clients
may see (running or paused, or between the two), and the creation counter that orders listings
survives restarts (each row carries its value).
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from aenv.core.models import SandboxState
from aenv.errors import SandboxGone, SandboxNotFound
from aenv.runtime.base import ResourceSample, SandboxSpec
from aenv.store.gone_log import Gone
from aenv.store.sqlite import SandboxRow

METRICS_HISTORY = 720  # one hour of samples at the sampler's 5 s
SampleRow = tuple[float, int, float, int, int, int, int, int]


class SampleHistory:
    """A sandbox's recent resource samples, kept as plain tuples of numbers: the garbage collector
    stops tracking such a tuple after the first collection it survives, so an hour of history on a
    thousand sandboxes (720,000 samples) does not lengthen every full collection of the server (and
    so the event loop's pauses), as as many objects would."""

    __slots__ = ("_rows",)

    def __init__(self, maxlen: int = METRICS_HISTORY) -> None:
        self._rows: deque[SampleRow] = deque(maxlen=maxlen)

    def append(self, s: ResourceSample) -> None:
        self._rows.append((s.timestamp, s.cpu_count, s.cpu_used_pct, s.mem_used, s.mem_total, s.mem_cache,
                           s.disk_used, s.disk_total))

    def last_timestamp(self) -> float | None:
        return self._rows[-1][0] if self._rows else None

    def between(self, lo: float, hi: float) -> list[ResourceSample]:
        """The samples taken from ``lo`` to ``hi`` (both included), oldest first."""
        return [ResourceSample(*row) for row in self._rows if lo <= row[0] <= hi]

    def __len__(self) -> int:
        return len(self._rows)


@dataclass
class LiveSandbox:
    """In-memory view of one sandbox: its row, a lock that serialises transitions, its samples."""

    row: SandboxRow
    spec: SandboxSpec
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    samples: SampleHistory = field(default_factory=SampleHistory)

    @property
    def id(self) -> str:
        return self.row.id

    @property
    def state(self) -> SandboxState:
        return SandboxState(self.row.state)


class SandboxTable:
    def __init__(self, gone: Callable[[str], Gone | None] | None = None) -> None:
        self._live: dict[str, LiveSandbox] = {}
        self._seq = 0
        self._gone = gone  # the tombstone of a sandbox that ended (store/gone_log.py), for the error's reason

    # ---- membership -----------------------------------------------------------------------------
    def add(self, sbx: LiveSandbox) -> None:
        self._live[sbx.id] = sbx

    def discard(self, sandbox_id: str) -> LiveSandbox | None:
        return self._live.pop(sandbox_id, None)

    def __contains__(self, sandbox_id: object) -> bool:
        return sandbox_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[LiveSandbox]:
        return iter(list(self._live.values()))  # a copy: flows add and drop entries while iterating

    def ids(self) -> set[str]:
        return set(self._live)

    # ---- lookups --------------------------------------------------------------------------------
    def find(self, sandbox_id: str) -> LiveSandbox | None:
        """The entry in whatever state (starting, killing, ...), or None."""
        return self._live.get(sandbox_id)

    def get(self, sandbox_id: str) -> LiveSandbox:
        """A sandbox E2B clients may see (running or paused, or on its way between them: callers wait
        for its lock and check the state again); SandboxNotFound otherwise."""
        sbx = self._live.get(sandbox_id)
        if sbx is None or not sbx.state.visible:
            raise self.not_found(sandbox_id)
        return sbx

    def not_found(self, sandbox_id: str) -> SandboxNotFound:
        """The error for an ID no client may use: SandboxGone with the reason where it existed and ended."""
        tomb = self._gone(sandbox_id) if self._gone is not None and sandbox_id not in self._live else None
        if tomb is None:
            return SandboxNotFound(sandbox_id)
        at = dt.datetime.fromtimestamp(tomb.at, dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
        return SandboxGone(sandbox_id, tomb.reason, tomb.detail, at)

    def template_ids_in_use(self) -> set[str]:
        return {s.row.template_id for s in self._live.values()}

    def depending_on(self, snapshot_id: str) -> list[str]:
        """Sandboxes that need this snapshot's files while they live (``depends_on``)."""
        return [s.id for s in self._live.values() if snapshot_id in s.row.depends_on]

    def snapshots_in_use(self) -> set[str]:
        """Every snapshot a live sandbox depends on or descends from (its lineage head)."""
        used = {d for s in self._live.values() for d in s.row.depends_on}
        return used | {s.row.lineage_head for s in self._live.values() if s.row.lineage_head}

    def counts_by_state(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self._live.values():
            out[s.row.state] = out.get(s.row.state, 0) + 1
        return out

    # ---- creation order -------------------------------------------------------------------------
    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def saw_seq(self, seq: int) -> None:
        """A row recovered at start-up: later sandboxes sort after it."""
        self._seq = max(self._seq, seq)

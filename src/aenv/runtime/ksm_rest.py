"""When the host's ksmd may rest (``ksm_rest``): merging has settled and nothing new has started.

ksmd scans every mergeable page over and over. Once the sandboxes it has seen are merged, another
scan finds (almost) nothing, yet it still costs CPU, and it competes with the sandboxes at work: a
command in a merged sandbox writes pages ksmd is walking and merging back. Measured (400 idle
merged ns sandboxes, ``commands.run("true")`` in each, 4 at once, 2 cores): p99 90 ms with ksmd
scanning, 33 ms with it stopped. So ksmd rests (``run`` = 0: merged pages stay merged) once

* ``LEAST_SCANS`` (three) full scans have ended since the last sandbox start could be marked (its
  ``ksm_idle_s`` and a margin: an idle sandbox's agent and envd mark themselves then). Three, because
  the kernel puts a newly mergeable process just behind ksmd's cursor: the scan under way when it is
  marked passes it by, the next merges its pages that match one already shared and notes the others'
  checksums, and only the one after merges pages the new sandboxes have in common with each other
  but not with any shared page (seen: a ramp to 1,000 sandboxes rested after two, and its last 254
  sandboxes, marked, visited once, identical to each other, stayed unmerged at 31.6 MB each), and
* the later of them merged less than ``SETTLE_GROWTH`` more pages, or ``MOST_SCANS`` have ended
  (sandboxes at work write pages that ksmd merges back, and a command writes them again: that
  churn never settles, and is not worth a scanning ksmd),

and scans again when a sandbox starts (an ID running that was not: a create, a fork child, a
resume), or once ``MemAvailable`` has fallen ``CREEP`` of ``MemTotal`` since it rested (sandboxes that
went idle only later, and pages that commands wrote, merged again).

Pure bookkeeping, fed by ``Ksm.adjust`` from the metrics sampler (every few seconds): the counters
are ksmd's (host-wide), the clock is the caller's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

SETTLE_GROWTH = 0.01  # a scan that merged less than this share more pages found nothing new
LEAST_SCANS = 3  # full scans after the last start's marks before any rest (the module docstring)
MOST_SCANS = 4  # full scans after the last start's marks, settled or not
CREEP = 0.05  # share of MemTotal MemAvailable may fall while ksmd rests before it scans again: above the
# first commands' copy-on-write in a merged fleet (400 sandboxes here: ~1.1 GB, 4.7 %), which a scan would only
# merge back for the next command to write again
MARK_MARGIN_S = 2.0  # after a start's ksm_idle_s: its /init and the agent's own mark


@dataclass
class RestPolicy:
    idle_s: float  # ksm_idle_s: a started sandbox is marked mergeable this long after its last request
    started_at: float = -math.inf  # the caller's clock at the last start seen
    running: frozenset[str] = frozenset()
    _first_scans: int | None = None  # full_scans when first seen after the last start could be marked
    _seen: tuple[int, int] | None = None  # (full_scans, pages_sharing) when full_scans last moved
    rested_available_kb: int | None = None  # MemAvailable when ksmd was rested
    total_kb: int = 0
    rests: int = 0  # how often ksmd was rested (shown: a bench waits for one)
    why: str = ""  # why it last rested, for the log and /aenv/info

    def note(self, running: Iterable[str], now: float) -> bool:
        """Which sandboxes run now; True when one started since the last call (an ID not running then)."""
        ids = frozenset(running)
        started = bool(ids - self.running)
        self.running = ids
        if started:
            self.started_at = now
            self._first_scans = self._seen = None
        return started

    def restart(self) -> None:
        """ksmd scans again: settling is counted from the scans that follow."""
        self._first_scans = self._seen = None
        self.rested_available_kb = None

    def settled(self, full_scans: int, pages_sharing: int, now: float) -> bool:
        """While ksmd scans: whether it may rest now (the module docstring's two conditions)."""
        if now < self.started_at + self.idle_s + MARK_MARGIN_S:
            return False
        if self._first_scans is None or self._seen is None:
            self._first_scans, self._seen = full_scans, (full_scans, pages_sharing)
            return False
        scans_before, sharing_before = self._seen
        if full_scans == scans_before:
            return False
        self._seen = (full_scans, pages_sharing)
        grew = pages_sharing - sharing_before
        scans = full_scans - self._first_scans
        if scans < LEAST_SCANS or (grew > SETTLE_GROWTH * max(sharing_before, 1) and scans < MOST_SCANS):
            return False
        self.why = (f"merging settled: {scans} full scans since the last start, {max(grew, 0)} more pages "
                    "merged by the last")
        return True

    def rested(self, available_kb: int | None, total_kb: int | None) -> None:
        self.rests += 1
        self.rested_available_kb, self.total_kb = available_kb, total_kb or 0

    def crept(self, available_kb: int | None) -> bool:
        """While ksmd rests: whether MemAvailable has fallen ``CREEP`` of MemTotal since."""
        if available_kb is None or self.rested_available_kb is None or not self.total_kb:
            return False
        return self.rested_available_kb - available_kb > CREEP * self.total_kb

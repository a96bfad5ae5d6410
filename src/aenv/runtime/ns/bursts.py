"""A team's burst gives way to another team's creates: the burst's starts in flight drop to the lowest CPU
weight while another team has a create in flight, and go back at once after.

Why only then: a start is CPU-bound, and on a small host a burst's CRIU restores (which run in the new
sandboxes' cgroups) take the CPU from another team's lone create (team B: 6.2 ms alone, 37.6 ms during
team A's burst of 200, ``bench/teams.py``). At the lowest weight throughout, B's create took 19.8 ms but
the burst 19.5 s instead of 12.2 (it lost to every live sandbox and pool refill too); weighed down only
while B has a create in flight, the burst loses only those moments. Core says when
(``core/admission.py``: ``contended``); which starts are a burst's is ``SandboxSpec.in_burst``.

A pool refill during a burst counts as another team's create: a team with a burst in flight takes
nothing from its pool (``in_burst``), so a refill then is another team's next create. At the pool's
lowest weight it waited behind the burst for seconds, and the other team's next create paid a full
restore (measured: team B's creates alternated 5-30 ms from the pool with 170-570 ms without). So a
refill that begins while burst starts are in flight runs at the ordinary weight, the burst yields
while it runs, and the entry goes back to the pool's weight once restored.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Protocol


class Weighable(Protocol):
    def set_weight(self, low: bool) -> None: ...


class BurstWeights:
    """The cgroups of the burst starts in flight, and whether they yield now."""

    def __init__(self) -> None:
        self._on = False  # core: another team has a create in flight
        self._refills = 0  # pool refills begun while burst starts were in flight, still running
        self._starting: set[Weighable] = set()
        self._lock = threading.Lock()  # a start registers from the loop, weighs itself from a restore thread

    @property
    def yielding(self) -> bool:
        return self._on or self._refills > 0

    @property
    def busy(self) -> bool:
        """Whether burst starts are in flight (a refill beginning now is another team's: see above)."""
        return bool(self._starting)

    def set(self, on: bool) -> None:
        """Core's word: another team has a create in flight (``on``) or not."""
        with self._lock:
            self._on = on
        self._apply()

    def _apply(self) -> None:
        with self._lock:
            low, starting = self.yielding, list(self._starting)
        for cg in starting:
            _weigh(cg, low)

    @contextlib.contextmanager
    def refilling(self, cg: Weighable) -> Iterator[None]:
        """A pool refill (``cg``: its cgroups, at the ordinary weight) that began during a burst: the burst
        yields until it is done, and it goes back to the pool's weight."""
        with self._lock:
            self._refills += 1
        self._apply()
        try:
            yield
        finally:
            with self._lock:
                self._refills -= 1
            self._apply()
            _weigh(cg, True)

    @contextlib.contextmanager
    def starting(self, cg: Weighable) -> Iterator[None]:
        """``cg`` is a burst start's until the block ends (the start done or failed): it follows
        :meth:`set` meanwhile, and leaves at the ordinary weight (a live sandbox's)."""
        with self._lock:
            self._starting.add(cg)
        try:
            yield
        finally:
            with self._lock:
                self._starting.discard(cg)
            _weigh(cg, False)

    def weigh(self, cg: Weighable) -> None:
        """Once ``cg`` exists (its start made it): the weight it should have now."""
        if self.yielding:
            _weigh(cg, True)


def _weigh(cg: Weighable, low: bool) -> None:
    with contextlib.suppress(OSError):  # not made yet (it is weighed once made) or already gone
        cg.set_weight(low=low)


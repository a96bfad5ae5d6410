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

The writes themselves run in a thread of their own (``_Weigher``), not in the caller's: the switch is
thrown from the server's loop as another team's create begins and ends, and during a burst each
``cpu.weight`` write took ~0.7 ms (cgroup locks the burst's restores hold), several per switch - on
the very create the switch is for (py-spy of the loop during a burst of 200). The thread applies the
latest state in order, so a start that has ended always gets its ordinary weight last.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Protocol

IDLE_S = 2.0  # the weigher thread ends after this long with nothing to do (a later switch starts another)


class Weighable(Protocol):
    def set_weight(self, low: bool) -> None: ...


class BurstWeights:
    """The cgroups of the burst starts in flight, and whether they yield now."""

    def __init__(self) -> None:
        self._on = False  # core: another team has a create in flight
        self._refills = 0  # pool refills begun while burst starts were in flight, still running
        self._starting: set[Weighable] = set()
        # a start registers from the loop, weighs itself from a restore thread; the weigher reads both
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending = False  # the starts' weights are to be (re)applied
        self._busy = False  # the weigher is applying
        self._then: list[tuple[Weighable, bool]] = []  # single writes, after the next pass (start ended, refill done)
        self._worker: threading.Thread | None = None

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
            self._ask()

    def _ask(self, then: tuple[Weighable, bool] | None = None) -> None:
        """(Lock held.) Have the weigher apply the current state to the starts in flight (no ``then``),
        or write ``then`` after any such pass."""
        if then is None:
            self._pending = True
        else:
            self._then.append(then)
        if self._worker is None:
            self._worker = threading.Thread(target=self._weigher, name="aenv-burst-weights", daemon=True)
            self._worker.start()
        self._wake.notify()

    def _weigher(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._then:
                    if not self._wake.wait(IDLE_S) and not self._pending and not self._then:
                        self._worker = None
                        return
                starting = list(self._starting) if self._pending else []
                low, then = self.yielding, self._then
                self._pending, self._busy = False, True
                self._then = []
            try:
                for cg in starting:
                    _weigh(cg, low)
                for cg, weight in then:
                    _weigh(cg, weight)
            finally:
                with self._lock:
                    self._busy = False
                    self._wake.notify_all()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every switch so far is written (tests; a shutdown that must see them)."""
        with self._lock:
            return self._wake.wait_for(lambda: not (self._pending or self._then or self._busy), timeout)

    @contextlib.contextmanager
    def refilling(self, cg: Weighable) -> Iterator[None]:
        """A pool refill (``cg``: its cgroups, at the ordinary weight) that began during a burst: the burst
        yields until it is done, and it goes back to the pool's weight."""
        with self._lock:
            self._refills += 1
            self._ask()  # the burst yields
        try:
            yield
        finally:
            with self._lock:
                self._refills -= 1
                self._ask()  # the burst may go back
                self._ask(then=(cg, True))

    @contextlib.contextmanager
    def starting(self, cg: Weighable) -> Iterator[None]:
        """``cg`` is a burst start's until the block ends (the start done or failed): it follows
        :meth:`set` meanwhile, and leaves at the ordinary weight (a live sandbox's), written after any
        pass that still counted it among the starts."""
        with self._lock:
            self._starting.add(cg)
        try:
            yield
        finally:
            with self._lock:
                self._starting.discard(cg)
                self._ask(then=(cg, False))

    def weigh(self, cg: Weighable) -> None:
        """Once ``cg`` exists (its start made it, in the restore's thread): the weight it should have now."""
        if self.yielding:
            _weigh(cg, True)


def _weigh(cg: Weighable, low: bool) -> None:
    with contextlib.suppress(OSError):  # not made yet (it is weighed once made) or already gone
        cg.set_weight(low=low)

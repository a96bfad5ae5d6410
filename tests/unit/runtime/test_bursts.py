"""A burst's starts give way to another team's creates (``runtime/ns/bursts.py``): which cgroups follow the
switch, what a start made while it is on gets, and that every start leaves at the ordinary weight."""

from __future__ import annotations

import threading

from aenv.runtime.ns.bursts import BurstWeights


class _Cgroup:
    def __init__(self, exists: bool = True) -> None:
        self.exists = exists
        self.weights: list[bool] = []

    def set_weight(self, low: bool) -> None:
        if not self.exists:
            raise FileNotFoundError("cpu.shares")
        self.weights.append(low)


def test_starts_in_flight_follow_the_switch_and_leave_at_the_ordinary_weight() -> None:
    bursts = BurstWeights()
    one, two, done = _Cgroup(), _Cgroup(), _Cgroup()
    with bursts.starting(done):
        pass
    assert bursts.flush() and done.weights == [False]
    with bursts.starting(one), bursts.starting(two):
        bursts.weigh(one)  # made while off: nothing to do
        assert bursts.flush() and one.weights == []
        bursts.set(True)
        assert bursts.flush() and one.weights == [True] and two.weights == [True]
        bursts.set(False)
        assert bursts.flush() and one.weights == [True, False]
        bursts.set(True)
        assert bursts.flush()
    assert bursts.flush()
    assert one.weights == [True, False, True, False] and two.weights == [True, False, True, False]
    bursts.set(False)
    assert bursts.flush()
    assert done.weights == [False] and one.weights[-1] is False  # ended starts are no longer touched
    assert len(one.weights) == 4


def test_a_start_made_while_on_is_weighed_once_it_exists() -> None:
    bursts = BurstWeights()
    bursts.set(True)
    cg = _Cgroup(exists=False)
    with bursts.starting(cg):  # registered before its cgroup is made: the switch cannot reach it yet
        bursts.set(True)
        assert bursts.flush() and cg.weights == []
        cg.exists = True
        bursts.weigh(cg)  # made: as the burst is now
        assert cg.weights == [True]
        cg.exists = False  # the start failed and its cgroup went: leaving is quiet
    assert bursts.flush() and cg.weights == [True]


def test_a_refill_during_a_burst_goes_first_and_back_to_the_pools_weight() -> None:
    """A pool refill begun while burst starts are in flight is another team's next create: the burst
    yields while it runs (whatever core says), and the entry ends at the pool's lowest weight."""
    bursts = BurstWeights()
    start, refill = _Cgroup(), _Cgroup()
    assert not bursts.busy
    with bursts.starting(start):
        assert bursts.busy and not bursts.yielding
        with bursts.refilling(refill):
            assert bursts.flush() and bursts.yielding and start.weights == [True]
            bursts.set(True)  # core: another team's create comes meanwhile
            bursts.set(False)  # and goes: the refill still runs, the burst still yields
            assert bursts.flush() and start.weights[-1] is True
        assert bursts.flush() and not bursts.yielding and start.weights[-1] is False
        assert refill.weights == [True]  # back to the pool's weight
    assert bursts.flush() and start.weights[-1] is False


class _SlowCgroup(_Cgroup):
    """A cgroup whose writes wait for ``release`` (cgroup locks held by a burst's restores)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.entered = threading.Event()

    def set_weight(self, low: bool) -> None:
        self.entered.set()
        self.release.wait(10)
        super().set_weight(low)


def test_the_switch_never_waits_for_the_writes() -> None:
    """Core throws the switch from the server's loop, on the create it is for: the writes happen in the
    weigher's thread, and a start that ends while a pass still counts it gets its ordinary weight last."""
    bursts = BurstWeights()
    slow = _SlowCgroup()
    with bursts.starting(slow):
        caller = threading.Thread(target=bursts.set, args=(True,))
        caller.start()
        caller.join(5)
        assert not caller.is_alive()  # returned while the write is still held
        assert slow.entered.wait(5) and slow.weights == []
    slow.release.set()  # the pass that still counted it writes low; its leaving comes after
    assert bursts.flush()
    assert slow.weights == [True, False]

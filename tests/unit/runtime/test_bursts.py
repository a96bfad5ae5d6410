"""A burst's starts give way to another team's creates (``runtime/ns/bursts.py``): which cgroups follow the
switch, what a start made while it is on gets, and that every start leaves at the ordinary weight."""

from __future__ import annotations

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
    assert done.weights == [False]
    with bursts.starting(one), bursts.starting(two):
        bursts.weigh(one)  # made while off: nothing to do
        assert one.weights == []
        bursts.set(True)
        assert one.weights == [True] and two.weights == [True]
        bursts.set(False)
        assert one.weights == [True, False]
        bursts.set(True)
    assert one.weights == [True, False, True, False] and two.weights == [True, False, True, False]
    bursts.set(False)
    assert done.weights == [False] and one.weights[-1] is False  # ended starts are no longer touched
    assert len(one.weights) == 4


def test_a_start_made_while_on_is_weighed_once_it_exists() -> None:
    bursts = BurstWeights()
    bursts.set(True)
    cg = _Cgroup(exists=False)
    with bursts.starting(cg):  # registered before its cgroup is made: the switch cannot reach it yet
        bursts.set(True)
        assert cg.weights == []
        cg.exists = True
        bursts.weigh(cg)  # made: as the burst is now
        assert cg.weights == [True]
        cg.exists = False  # the start failed and its cgroup went: leaving is quiet
    assert cg.weights == [True]


def test_a_refill_during_a_burst_goes_first_and_back_to_the_pools_weight() -> None:
    """A pool refill begun while burst starts are in flight is another team's next create: the burst
    yields while it runs (whatever core says), and the entry ends at the pool's lowest weight."""
    bursts = BurstWeights()
    start, refill = _Cgroup(), _Cgroup()
    assert not bursts.busy
    with bursts.starting(start):
        assert bursts.busy and not bursts.yielding
        with bursts.refilling(refill):
            assert bursts.yielding and start.weights == [True]
            bursts.set(True)  # core: another team's create comes meanwhile
            bursts.set(False)  # and goes: the refill still runs, the burst still yields
            assert start.weights[-1] is True
        assert not bursts.yielding and start.weights[-1] is False
        assert refill.weights == [True]  # back to the pool's weight
    assert start.weights[-1] is False

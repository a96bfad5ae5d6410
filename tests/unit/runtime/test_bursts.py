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

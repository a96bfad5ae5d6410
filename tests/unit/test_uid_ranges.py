"""uid ranges per team on ns: the range math, the slots a store hands out and keeps, and the slot core
picks for a sandbox's team (0, the shared range, wherever there is nothing to keep apart)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.core.uid_slots import UidRanges
from aenv.errors import StateError
from aenv.store.sqlite import Store
from aenv.store.uid_slots import UidSlots
from aenv.uid_ranges import RANGE, TOP, first_choice, host_base, slot_count, slot_of

FIRST = 1_200_000_000
TWO_TEAMS = {"a": {"keys": ["ka"]}, "b": {"keys": ["kb"]}}


def test_ranges_stack_from_the_first_uid_and_stay_below_the_top() -> None:
    n = slot_count(FIRST)
    assert n == (TOP - RANGE - FIRST) // RANGE + 1 == 47225
    assert host_base(FIRST, 0) == FIRST and host_base(FIRST, 3) == FIRST + 3 * RANGE
    assert host_base(FIRST, n - 1) + RANGE <= TOP  # the last range ends below (uid_t)-1
    for bad in (-1, n):
        with pytest.raises(ValueError, match="does not fit"):
            host_base(FIRST, bad)
    assert slot_count(0) == 0 and slot_count(TOP - RANGE + 1) == 0 and slot_count(TOP - RANGE) == 1
    assert slot_of(FIRST, FIRST + 5 * RANGE) == 5 and slot_of(FIRST, FIRST) == 0
    assert slot_of(FIRST, FIRST + 1) is None and slot_of(FIRST, FIRST - RANGE) is None  # not one of its ranges
    assert slot_of(FIRST, FIRST + n * RANGE) is None


def test_first_choice_is_stable_and_never_the_shared_slot() -> None:
    assert first_choice("a", FIRST) == first_choice("a", FIRST)  # the same on every node and restart
    assert {first_choice(t, FIRST) for t in ("a", "b", "c")} != {first_choice("a", FIRST)}
    assert all(1 <= first_choice(f"t{i}", FIRST) < slot_count(FIRST) for i in range(200))
    with pytest.raises(ValueError, match="no room"):
        first_choice("a", TOP - RANGE)


def test_store_keeps_a_slot_and_probes_past_taken_ones(tmp_path: Path) -> None:
    store = Store(tmp_path / "aenv.db")
    slots = UidSlots(store)
    assert slots.assign("a", 3, 6) == 3
    assert slots.assign("b", 3, 6) == 4  # 3 is a's: the next free one
    assert slots.assign("a", 5, 6) == 3  # given once, kept whatever the first choice says now
    assert slots.assign("c", 5, 6) == 5 and slots.assign("d", 5, 6) == 1  # wraps round, past slot 0
    assert slots.assign("e", 5, 6) == 2
    with pytest.raises(RuntimeError, match="no uid range left"):
        slots.assign("f", 1, 6)
    store.close()
    again = Store(tmp_path / "aenv.db")
    assert UidSlots(again).all() == {"a": 3, "b": 4, "c": 5, "d": 1, "e": 2}  # survives a restart
    again.close()


def _ranges(tmp_path: Path, **kw: object) -> tuple[UidRanges, Store]:
    store = Store(tmp_path / "aenv.db")
    return UidRanges(Settings(state_dir=tmp_path, runtime="ns", **kw), store), store  # type: ignore[arg-type]


@pytest.mark.parametrize("kw", [{}, {"api_keys": ["k1"]}, {"api_keys": ["k1", "k1"]},
                                {"teams": {"a": {"keys": ["k1", "k2"]}}}, {**{"teams": TWO_TEAMS}, "ns_userns_uid": 0}])
def test_nothing_to_keep_apart_means_the_shared_range(tmp_path: Path, kw: dict[str, object]) -> None:
    ranges, store = _ranges(tmp_path, **kw)
    assert not ranges.separate
    assert ranges.slot("") == ranges.slot("a") == ranges.slot("some-key-digest") == 0
    assert UidSlots(store).all() == {}  # nothing recorded
    store.close()


def test_two_teams_get_ranges_of_their_own_for_good(tmp_path: Path) -> None:
    ranges, store = _ranges(tmp_path, teams=TWO_TEAMS, admin_keys=["kadmin"])
    assert ranges.separate
    a, b, admin = ranges.slot("a"), ranges.slot("b"), ranges.slot("admin")
    assert 0 not in (a, b, admin) and len({a, b, admin}) == 3
    assert ranges.slot("") == 0  # an open server's team: the shared range
    assert a == first_choice("a", FIRST)  # no collision: where every node would put it
    store.close()
    again, store = _ranges(tmp_path, teams=TWO_TEAMS, admin_keys=["kadmin"])
    assert (again.slot("a"), again.slot("b"), again.slot("admin")) == (a, b, admin)  # after a restart
    store.close()


def test_a_slot_given_under_a_lower_first_uid_is_refused(tmp_path: Path) -> None:
    store = Store(tmp_path / "aenv.db")
    UidSlots(store).assign("a", 40000, slot_count(FIRST))
    store.close()
    ranges, store = _ranges(tmp_path, teams=TWO_TEAMS, ns_userns_uid=TOP - 10 * RANGE)
    with pytest.raises(StateError, match="no longer fits"):
        ranges.slot("a")
    store.close()

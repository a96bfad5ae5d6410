"""Host uid ranges of ns sandboxes: one 65536-uid range per team (``ns_userns_uid`` + slot * RANGE).

Why per team: a process that escaped its sandbox's PID and mount namespaces still runs as its host
uid; with one range for every sandbox it could signal or ptrace every other sandbox's processes. With
a range per team it reaches only its own team's. Slot 0 is ``ns_userns_uid`` itself: the range every
sandbox ran in before, kept for the team ``""`` and for every sandbox of a server with fewer than two
teams (``core/uid_slots.py`` decides; ``store/uid_slots.py`` remembers a team's slot).

The math only, no I/O: core, store and the ns runtime share it.
"""

from __future__ import annotations

import hashlib

RANGE = 65536  # uids/gids 0..65535 in a sandbox: what images use (nobody is 65534)
TOP = 2**32 - 1  # (uid_t)-1 is no uid; a range must end below it


def slot_count(first: int) -> int:
    """How many whole ranges fit from ``first`` up (slot 0 included); 0 if not even one does."""
    if first <= 0 or first + RANGE > TOP:
        return 0
    return (TOP - RANGE - first) // RANGE + 1


def host_base(first: int, slot: int) -> int:
    """The host uid that uid 0 of slot ``slot``'s range is. ValueError for a slot that does not fit."""
    if slot < 0 or slot >= slot_count(first):
        raise ValueError(f"uid range slot {slot} does not fit above ns_userns_uid = {first} "
                         f"(room for {slot_count(first)} ranges of {RANGE} below {TOP})")
    return first + slot * RANGE


def slot_of(first: int, base: int) -> int | None:
    """The slot whose range starts at host uid ``base``, or None (not one of ``first``'s ranges)."""
    off = base - first
    if off < 0 or off % RANGE or off // RANGE >= slot_count(first):
        return None
    return off // RANGE


def first_choice(team: str, first: int) -> int:
    """Where a team's slot is looked for first: derived from its ID (never 0), so servers that
    assign slots to the same teams mostly agree, and a snapshot's processes restore on another node
    of the team's. The store probes on from here on a collision."""
    n = slot_count(first)
    if n < 2:
        raise ValueError(f"ns_userns_uid = {first} leaves no room for a second uid range")
    return 1 + int.from_bytes(hashlib.sha256(team.encode()).digest()[:8], "big") % (n - 1)

"""Which uid range a sandbox's team runs in on ns (``aenv/uid_ranges.py``), for ``Context.spec_for``.

Why in core: the runtime must not know teams, only the range a sandbox's processes belong in
(``SandboxSpec.uid_slot``). A server with fewer than two teams (no keys, one key, one team and no
admin) keeps every sandbox in slot 0, the one shared range of before: nothing to keep apart, and its
snapshots keep restoring as they did. With two or more (the admin team counts) each team gets a slot
of its own the first time one of its sandboxes is started, recorded in the store for good
(``store/uid_slots.py``); the team ``""`` (an open server's) is always slot 0.
"""

from __future__ import annotations

import logging
import threading

from aenv.config import Settings
from aenv.errors import StateError
from aenv.store.sqlite import Store
from aenv.store.uid_slots import UidSlots
from aenv.uid_ranges import first_choice, slot_count

log = logging.getLogger("aenv.core")


def separate_ranges(settings: Settings) -> bool:
    """Whether teams get uid ranges of their own here: ns user namespaces on, two or more teams."""
    first = settings.ns_userns_uid
    if not first or settings.runtime == "vm" or len(settings.team_directory().teams()) < 2:
        return False
    if slot_count(first) < 2:
        log.warning("ns_userns_uid = %d leaves no room for a uid range per team: every team shares one", first)
        return False
    return True


class UidRanges:
    """Team → slot, cached (a slot never changes once given)."""

    def __init__(self, settings: Settings, store: Store) -> None:
        self.first = settings.ns_userns_uid
        self.separate = separate_ranges(settings)
        self._slots = UidSlots(store)
        self._known: dict[str, int] = {}
        self._lock = threading.Lock()

    def slot(self, owner: str) -> int:
        """The slot of ``owner``'s range (0: the shared one). Gives the team one on its first use."""
        if not self.separate or not owner:
            return 0
        with self._lock:
            slot = self._known.get(owner)
            if slot is None:
                count = slot_count(self.first)
                try:
                    slot = self._slots.assign(owner, first_choice(owner, self.first), count)
                except RuntimeError as exc:
                    raise StateError(str(exc)) from exc
                if slot >= count:  # given under a lower ns_userns_uid
                    raise StateError(f"team's uid range slot {slot} no longer fits above ns_userns_uid = "
                                     f"{self.first} (room for {count}); lower ns_userns_uid back")
                self._known[owner] = slot
            return slot

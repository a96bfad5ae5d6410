"""Which uid range slot each team's ns sandboxes run in (``aenv/uid_ranges.py``): one row per team,
written the first time the team needs one and never changed, so a restart (and every snapshot its
sandboxes left) finds the same range. The table is in ``sqlite.py``'s schema."""

from __future__ import annotations

from aenv.store.sqlite import Store, now


class UidSlots:
    def __init__(self, store: Store) -> None:
        self.store = store

    def get(self, team: str) -> int | None:
        rows = self.store._query("SELECT slot FROM uid_slots WHERE team = ?", (team,))
        return int(rows[0]["slot"]) if rows else None

    def assign(self, team: str, first_choice: int, count: int) -> int:
        """``team``'s slot: the recorded one, else the first free one from ``first_choice`` on (wrapping
        round, slot 0 never given: it is the shared range). RuntimeError when every slot is taken."""
        with self.store._tx() as db:
            row = db.execute("SELECT slot FROM uid_slots WHERE team = ?", (team,)).fetchone()
            if row is not None:
                return int(row["slot"])
            taken = {int(r["slot"]) for r in db.execute("SELECT slot FROM uid_slots")}
            for i in range(count - 1):
                slot = 1 + (first_choice - 1 + i) % (count - 1)
                if slot not in taken:
                    db.execute("INSERT INTO uid_slots (team, slot, created_at) VALUES (?, ?, ?)", (team, slot, now()))
                    return slot
        raise RuntimeError(f"no uid range left for team {team!r}: all {count - 1} are given to other teams")

    def all(self) -> dict[str, int]:
        return {r["team"]: int(r["slot"]) for r in self.store._query("SELECT team, slot FROM uid_slots")}

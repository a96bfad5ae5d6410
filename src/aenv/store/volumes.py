"""E2B volumes (``core/volumes.py``): one row per volume. The row is written (``creating``) before
the volume's directory is made and marked ``destroying`` before it is removed, so a restart (even
after kill -9) finishes what was cut short: ``ready`` rows are the volumes, the others are cleaned up.
Names are unique per owner (the API key's owner), as E2B's are per team. The table is in
``sqlite.py``'s schema. In cluster mode (the store's ``binder``) a volume is bound in the cluster
directory before its row is written (there a name is unique across the nodes) and unbound after its row
is deleted, as sandboxes are."""

from __future__ import annotations

from dataclasses import dataclass

from aenv.errors import Conflict, StoreError
from aenv.store.sqlite import Store

_COLUMNS = ("id", "name", "owner", "token", "state", "created_at")

CREATING, READY, DESTROYING = "creating", "ready", "destroying"


@dataclass
class VolumeRow:
    id: str
    name: str
    owner: str  # sha256 of the API key that made it ('' without auth): only that key sees it
    token: str  # the volume content API's bearer token
    state: str  # creating | ready | destroying
    created_at: float


class VolumeLog:
    def __init__(self, store: Store) -> None:
        self.store = store

    def put(self, row: VolumeRow) -> None:
        """Insert a new volume; a name the owner already uses (here, or on another node: the binder) is
        a Conflict."""
        binder, bound = self.store.binder, False
        try:
            with self.store._tx() as db:
                taken = db.execute("SELECT 1 FROM volumes WHERE owner = ? AND name = ?", (row.owner, row.name)).fetchone()
                if taken:
                    raise Conflict(f"a volume named '{row.name}' already exists", volume=row.name)
                if binder is not None:  # first: a fenced node, or a name taken elsewhere, writes nothing
                    binder.bind_volume(row.id, row.owner, row.name)
                    bound = True
                db.execute(f"INSERT INTO volumes ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})",
                           tuple(getattr(row, c) for c in _COLUMNS))  # fmt: skip
        except StoreError as exc:
            if bound and binder is not None:
                binder.unbind_volume(row.id, row.owner, row.name)
            raise StoreError(f"cannot record volume '{row.name}': {exc}") from exc

    def put_adopted(self, row: VolumeRow) -> None:
        """Record a volume taken over from a dead node (the directory binds it here already)."""
        with self.store._tx() as db:
            db.execute(f"INSERT OR REPLACE INTO volumes ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})",
                       tuple(getattr(row, c) for c in _COLUMNS))  # fmt: skip

    def set_state(self, volume_id: str, state: str) -> None:
        with self.store._tx() as db:
            db.execute("UPDATE volumes SET state = ? WHERE id = ?", (state, volume_id))

    def delete(self, volume_id: str) -> None:
        row = self.get(volume_id)
        with self.store._tx() as db:
            db.execute("DELETE FROM volumes WHERE id = ?", (volume_id,))
        if self.store.binder is not None and row is not None:
            self.store.binder.unbind_volume(row.id, row.owner, row.name)

    def get(self, volume_id: str) -> VolumeRow | None:
        rows = self.store._query("SELECT * FROM volumes WHERE id = ?", (volume_id,))
        return VolumeRow(**dict(rows[0])) if rows else None

    def by_name(self, owner: str, name: str) -> VolumeRow | None:
        rows = self.store._query("SELECT * FROM volumes WHERE owner = ? AND name = ?", (owner, name))
        return VolumeRow(**dict(rows[0])) if rows else None

    def of_owner(self, owner: str) -> list[VolumeRow]:
        return [VolumeRow(**dict(r)) for r in self.store._query(
            "SELECT * FROM volumes WHERE owner = ? AND state = ? ORDER BY created_at, id", (owner, READY))]

    def all(self) -> list[VolumeRow]:
        return [VolumeRow(**dict(r)) for r in self.store._query("SELECT * FROM volumes ORDER BY created_at, id")]

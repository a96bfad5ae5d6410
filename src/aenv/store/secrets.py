"""E2B secrets and the sandboxes' egress CAs, in the server's SQLite (tables in ``sqlite.py``'s schema),
so both survive a ``kill -9``.

A secret's value is write-only: it is stored here and read back only by :meth:`SecretLog.value_of`,
which the egress proxy calls when it puts the value into a request (``runtime/egress.py``). No row
type here carries the value, so no serializer can show it by mistake. Names are unique per owner (the
API key's owner, as volumes'); a secret of another owner is never found.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from aenv.errors import Conflict
from aenv.store.sqlite import Store

_META = ("id", "owner", "name", "version", "metadata", "created_at", "updated_at")


@dataclass
class SecretRow:
    """A secret's metadata, never its value."""

    id: str
    owner: str
    name: str
    version: int
    created_at: float
    updated_at: float
    metadata: dict[str, str] = field(default_factory=dict)


def _row(rec: Any) -> SecretRow:
    data = {k: rec[k] for k in _META}
    data["metadata"] = json.loads(data["metadata"] or "{}")
    return SecretRow(**data)


class SecretRows(Protocol):
    """Where secrets are kept: this node's SQLite (``SecretLog``), or in cluster mode the cluster's Redis
    (``secrets_redis.RedisSecretLog``), which every node shares."""

    def create(self, row: SecretRow, value: str) -> None: ...
    def update(self, owner: str, secret_id: str, value: str, metadata: dict[str, str] | None,
               at: float) -> SecretRow | None: ...  # fmt: skip
    def get(self, owner: str, secret_id: str) -> SecretRow | None: ...
    def by_name(self, owner: str, name: str) -> SecretRow | None: ...
    def page(self, owner: str, after: str, limit: int) -> list[SecretRow]: ...
    def delete(self, owner: str, secret_id: str) -> bool: ...
    def value_of(self, secret_id: str) -> str | None: ...


class SecretLog:
    def __init__(self, store: Store) -> None:
        self.store = store

    def create(self, row: SecretRow, value: str) -> None:
        """Insert a new secret; a name its owner already uses is a Conflict."""
        with self.store._tx() as db:
            taken = db.execute("SELECT 1 FROM secrets WHERE owner = ? AND name = ?", (row.owner, row.name)).fetchone()
            if taken:
                raise Conflict(f"a secret named '{row.name}' already exists", secret=row.name)
            db.execute("INSERT INTO secrets (id, owner, name, value, version, metadata, created_at, updated_at) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                       (row.id, row.owner, row.name, value, row.version, json.dumps(row.metadata),
                        row.created_at, row.updated_at))  # fmt: skip

    def update(self, owner: str, secret_id: str, value: str, metadata: dict[str, str] | None, at: float) -> SecretRow | None:
        """A new value (the next version) and, if given, new metadata; None if ``owner`` has no such secret."""
        with self.store._tx() as db:
            sets, args = "value = ?, version = version + 1, updated_at = ?", [value, at]
            if metadata is not None:
                sets += ", metadata = ?"
                args.append(json.dumps(metadata))
            cur = db.execute(f"UPDATE secrets SET {sets} WHERE owner = ? AND id = ?", (*args, owner, secret_id))
            if cur.rowcount == 0:
                return None
        return self.get(owner, secret_id)

    def get(self, owner: str, secret_id: str) -> SecretRow | None:
        rows = self.store._query(f"SELECT {', '.join(_META)} FROM secrets WHERE owner = ? AND id = ?", (owner, secret_id))
        return _row(rows[0]) if rows else None

    def by_name(self, owner: str, name: str) -> SecretRow | None:
        rows = self.store._query(f"SELECT {', '.join(_META)} FROM secrets WHERE owner = ? AND name = ?", (owner, name))
        return _row(rows[0]) if rows else None

    def page(self, owner: str, after: str, limit: int) -> list[SecretRow]:
        """``owner``'s secrets by name, those after ``after``, at most ``limit``."""
        rows = self.store._query(f"SELECT {', '.join(_META)} FROM secrets WHERE owner = ? AND name > ? "
                                 "ORDER BY name LIMIT ?", (owner, after, limit))  # fmt: skip
        return [_row(r) for r in rows]

    def delete(self, owner: str, secret_id: str) -> bool:
        with self.store._tx() as db:
            return db.execute("DELETE FROM secrets WHERE owner = ? AND id = ?", (owner, secret_id)).rowcount > 0

    def value_of(self, secret_id: str) -> str | None:
        """The current value: for the egress proxy only (the sandbox's rules were bound to this ID
        when its owner set them)."""
        rows = self.store._query("SELECT value FROM secrets WHERE id = ?", (secret_id,))
        return str(rows[0]["value"]) if rows else None

    def count(self) -> int:
        return int(self.store._query("SELECT COUNT(*) AS n FROM secrets", ())[0]["n"])


class CaLog:
    """Each sandbox's egress CA (PEM certificate and key), kept while the sandbox is."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def get(self, sandbox_id: str) -> tuple[bytes, bytes] | None:
        rows = self.store._query("SELECT cert_pem, key_pem FROM egress_cas WHERE sandbox_id = ?", (sandbox_id,))
        return (rows[0]["cert_pem"].encode(), rows[0]["key_pem"].encode()) if rows else None

    def put(self, sandbox_id: str, cert_pem: bytes, key_pem: bytes, at: float) -> None:
        with self.store._tx() as db:
            db.execute("INSERT OR IGNORE INTO egress_cas (sandbox_id, cert_pem, key_pem, created_at) VALUES (?, ?, ?, ?)",
                       (sandbox_id, cert_pem.decode(), key_pem.decode(), at))  # fmt: skip

    def delete(self, sandbox_id: str) -> None:
        with self.store._tx() as db:
            db.execute("DELETE FROM egress_cas WHERE sandbox_id = ?", (sandbox_id,))

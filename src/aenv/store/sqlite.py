"""Metadata persistence in SQLite (WAL): sandboxes, templates, snapshots.

Small typed functions over one connection. Writes happen *before* side effects become visible
(a sandbox row exists in state ``starting`` before its processes do), so a restart can reconcile.
Calls are synchronous: with WAL and ``synchronous=NORMAL`` a commit is a page write to the log with no
fsync, well under a millisecond, cheaper than a thread hop. Driver errors become ``StoreError`` here.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Protocol

from aenv.errors import StoreError
from aenv.kinds import SandboxState, SnapshotMode, TemplateKind

SCHEMA_VERSION = 7  # v6: owners (teams), the secrets and egress_cas tables; v7: uid_slots (new tables: CREATE IF NOT EXISTS below)

# Columns added after a database was first created, per table, as (name, SQL definition). A store
# opening an older database adds the ones it lacks (``ALTER TABLE ... ADD COLUMN``, existing rows get
# the default) and records the new schema version; the CREATE statements below already have them.
_ADDED_COLUMNS: dict[str, tuple[tuple[str, str], ...]] = {
    "sandboxes": (
        ("auto_pause_memory", "INTEGER NOT NULL DEFAULT 1"),  # v2: autoPauseMemory
        ("pause_mode", "TEXT"),  # v2: what the current (or last) pause keeps: full | filesystem
        ("network", "TEXT NOT NULL DEFAULT '{}'"),  # v3: E2B's network settings (egress rules, masking)
        ("traffic_token", "TEXT"),  # v3: required on user ports when allowPublicTraffic is false
        ("has_network", "INTEGER"),  # v4: made with a way out (NULL: a row from before v4)
        ("volume_mounts", "TEXT NOT NULL DEFAULT '[]'"),  # v5: E2B volumeMounts (core/volumes.py)
        ("owner", "TEXT NOT NULL DEFAULT ''"),  # v6: the team that made it (aenv/teams.py)
    ),
    "templates": (
        ("owner", "TEXT NOT NULL DEFAULT ''"),  # v6: '' = the server's own, seen by every team
        ("public", "INTEGER NOT NULL DEFAULT 0"),  # v6: published to every team (E2B's `public`)
    ),
    "snapshots": (("owner", "TEXT NOT NULL DEFAULT ''"),),  # v6
    "gone_sandboxes": (("owner", "TEXT NOT NULL DEFAULT ''"),),  # v6: who may hear the reason
}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    template_id TEXT NOT NULL,
    alias TEXT,
    state TEXT NOT NULL,
    runtime TEXT NOT NULL,
    started_at REAL NOT NULL,
    end_at REAL NOT NULL,
    paused_at REAL,
    auto_pause INTEGER NOT NULL DEFAULT 0,
    auto_resume INTEGER NOT NULL DEFAULT 0,
    auto_pause_memory INTEGER NOT NULL DEFAULT 1,
    pause_mode TEXT,
    cpu_count INTEGER NOT NULL,
    memory_mb INTEGER NOT NULL,
    disk_mb INTEGER NOT NULL,
    allow_internet INTEGER NOT NULL DEFAULT 1,
    metadata TEXT NOT NULL DEFAULT '{}',
    env_vars TEXT NOT NULL DEFAULT '{}',
    access_token TEXT,
    network TEXT NOT NULL DEFAULT '{}',
    traffic_token TEXT,
    has_network INTEGER,
    volume_mounts TEXT NOT NULL DEFAULT '[]',
    runtime_state TEXT NOT NULL DEFAULT '{}',
    idempotency_key TEXT,
    created_seq INTEGER NOT NULL DEFAULT 0,
    lineage_head TEXT,
    depends_on TEXT NOT NULL DEFAULT '[]',
    owner TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS sandboxes_started ON sandboxes(started_at);
CREATE TABLE IF NOT EXISTS templates (
    id TEXT PRIMARY KEY,
    alias TEXT UNIQUE,
    kind TEXT NOT NULL,
    source TEXT,
    rootfs TEXT NOT NULL,
    lowers TEXT NOT NULL DEFAULT '[]',
    config TEXT NOT NULL DEFAULT '{}',
    cpu_count INTEGER NOT NULL,
    memory_mb INTEGER NOT NULL,
    disk_mb INTEGER NOT NULL,
    size_bytes INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    pinned_layers TEXT NOT NULL DEFAULT '[]',
    owner TEXT NOT NULL DEFAULT '',
    public INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS snapshots (
    id TEXT PRIMARY KEY,
    name TEXT,
    sandbox_id TEXT,
    parent_id TEXT,
    template_id TEXT NOT NULL,
    runtime TEXT NOT NULL,
    mode TEXT NOT NULL,
    state TEXT NOT NULL,
    internal INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    dir TEXT NOT NULL,
    result TEXT NOT NULL DEFAULT '{}',
    published INTEGER NOT NULL DEFAULT 0,
    size_bytes INTEGER NOT NULL DEFAULT 0,
    owner TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS snapshots_sandbox ON snapshots(sandbox_id);
-- Lifecycle webhook deliveries (store/webhook_log.py): a new table, so older databases get it here too.
CREATE TABLE IF NOT EXISTS webhook_deliveries (
    id TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    event TEXT NOT NULL,
    sandbox_id TEXT NOT NULL,
    body TEXT NOT NULL,
    state TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_at REAL NOT NULL,
    created_at REAL NOT NULL,
    delivered_at REAL,
    last_status INTEGER,
    last_error TEXT
);
CREATE INDEX IF NOT EXISTS webhook_deliveries_due ON webhook_deliveries(state, next_at);
-- Sandboxes that ended, and why (store/gone_log.py): what a late request about one is told.
CREATE TABLE IF NOT EXISTS gone_sandboxes (
    id TEXT PRIMARY KEY,
    reason TEXT NOT NULL,
    detail TEXT NOT NULL DEFAULT '',
    at REAL NOT NULL,
    owner TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS gone_sandboxes_at ON gone_sandboxes(at);
-- What happened to each sandbox, for GET /sandboxes/{id}/logs (store/event_log.py): lines written in
-- batches off the request path, kept as long as tombstones.
CREATE TABLE IF NOT EXISTS sandbox_events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    sandbox_id TEXT NOT NULL,
    at REAL NOT NULL,
    level TEXT NOT NULL,
    message TEXT NOT NULL,
    fields TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS sandbox_events_sandbox ON sandbox_events(sandbox_id, seq);
CREATE INDEX IF NOT EXISTS sandbox_events_at ON sandbox_events(at);
-- E2B volumes (store/volumes.py): a row is written before its directory exists and deleted after
-- the directory is gone, so a restart finds every volume and removes half-made or half-destroyed ones.
CREATE TABLE IF NOT EXISTS volumes (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    owner TEXT NOT NULL,
    token TEXT NOT NULL,
    state TEXT NOT NULL,
    created_at REAL NOT NULL,
    UNIQUE(owner, name)
);
-- Heartbeat leases (store/leases.py): a client that stops heartbeating loses its sandboxes.
CREATE TABLE IF NOT EXISTS leases (
    id TEXT PRIMARY KEY,
    owner TEXT,
    name TEXT NOT NULL DEFAULT '',
    ttl REAL NOT NULL,
    expires_at REAL NOT NULL,
    created_at REAL NOT NULL,
    ended_at REAL,
    end_reason TEXT
);
-- E2B secrets (store/secrets.py): write-only values an owner stores for the egress proxy to put into
-- requests (network.rules); no API answer carries a value. Names are unique per owner.
CREATE TABLE IF NOT EXISTS secrets (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    name TEXT NOT NULL,
    value TEXT NOT NULL,
    version INTEGER NOT NULL,
    metadata TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    UNIQUE(owner, name)
);
-- Each sandbox's egress CA (store/secrets.py): the egress proxy signs the certificates it presents
-- for a sandbox's rule domains with it; the sandbox trusts its certificate, never sees its key.
CREATE TABLE IF NOT EXISTS egress_cas (
    sandbox_id TEXT PRIMARY KEY,
    cert_pem TEXT NOT NULL,
    key_pem TEXT NOT NULL,
    created_at REAL NOT NULL
);
-- ns uid range slot of each team (store/uid_slots.py, aenv/uid_ranges.py): v7, never changed once given.
CREATE TABLE IF NOT EXISTS uid_slots (
    team TEXT PRIMARY KEY,
    slot INTEGER NOT NULL UNIQUE,
    created_at REAL NOT NULL
);
"""


@dataclass
class SandboxRow:
    id: str
    template_id: str
    state: SandboxState
    runtime: str
    started_at: float
    end_at: float
    cpu_count: int
    memory_mb: int
    disk_mb: int
    alias: str | None = None
    paused_at: float | None = None
    auto_pause: bool = False
    auto_resume: bool = False
    allow_internet: bool = True
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    access_token: str | None = None
    runtime_state: dict[str, Any] = field(default_factory=dict)
    idempotency_key: str | None = None
    created_seq: int = 0
    lineage_head: str | None = None  # the snapshot this sandbox's state descends from (checkpoint tree)
    depends_on: list[str] = field(default_factory=list)  # snapshots whose files this sandbox needs while alive
    auto_pause_memory: bool = True  # an expiry pause keeps memory (False: files only)
    # What the pause keeps, written before the runtime acts: full (processes and memory) or
    # filesystem (files only; the resume is a cold start). None while it never was paused.
    pause_mode: SnapshotMode | None = None
    # E2B's network settings as the API shows them: allowOut, denyOut, dnsServers (the egress
    # policy, runtime/netpolicy.py), allowPublicTraffic, maskRequestHost. Empty: none given.
    network: dict[str, Any] = field(default_factory=dict)
    traffic_token: str | None = None  # e2b-traffic-access-token for user ports (allowPublicTraffic: false)
    # Whether the sandbox was made with a way out (slirp): fixed at create, while allow_internet is
    # what E2B's allowInternetAccess says now (an update can turn it off and on again). None: a row
    # from before v4, where core derives it from the other fields.
    has_network: bool | None = None
    # E2B volumeMounts as bound: [{"name", "path", "volumeID", "readOnly"}] (core/volumes.py).
    volume_mounts: list[dict[str, Any]] = field(default_factory=list)
    owner: str = ""  # the team that made it (aenv/teams.py); '' on a server without keys

    def __post_init__(self) -> None:
        self.state = SandboxState(self.state)  # the database holds the plain value
        if self.has_network is not None:
            self.has_network = bool(self.has_network)  # the database holds 0/1
        if self.pause_mode is not None:
            self.pause_mode = SnapshotMode(self.pause_mode)


@dataclass
class TemplateRow:
    id: str
    kind: TemplateKind
    rootfs: str
    cpu_count: int
    memory_mb: int
    disk_mb: int
    created_at: float
    alias: str | None = None
    source: str | None = None  # image reference or snapshot parent
    lowers: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    size_bytes: int = 0
    pinned_layers: list[str] = field(default_factory=list)
    owner: str = ""  # the team that made it; '' = the server's own (base, code-interpreter-v1): every team's
    public: bool = False  # seen and used by every team (E2B's template `public`)

    def __post_init__(self) -> None:
        self.kind = TemplateKind(self.kind)


@dataclass
class SnapshotRow:
    id: str
    template_id: str
    runtime: str
    mode: SnapshotMode
    state: str  # "creating" | "ready"
    created_at: float
    dir: str
    name: str | None = None
    sandbox_id: str | None = None
    parent_id: str | None = None
    internal: bool = False  # fork scratch snapshots: hidden, collected when nothing depends on them
    result: dict[str, Any] = field(default_factory=dict)
    published: bool = False
    size_bytes: int = 0
    owner: str = ""  # the team of the sandbox it was taken of

    def __post_init__(self) -> None:
        self.mode = SnapshotMode(self.mode)


_JSON_FIELDS = {"volume_mounts", "network", "metadata", "env_vars", "runtime_state", "lowers", "config", "pinned_layers", "depends_on", "result"}
_BOOL_FIELDS = {"auto_pause", "auto_resume", "auto_pause_memory", "allow_internet", "internal", "published", "public"}


_FIELD_NAMES: dict[type[Any], tuple[str, ...]] = {}


def _field_names(cls: type[Any]) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls))
    return names


def _to_db(row: Any) -> dict[str, Any]:
    # Shallow, not dataclasses.asdict: its deep copy of every dict and list is wasted on values that
    # are serialised right below (it was a third of a sandbox insert on the create path).
    out = {name: getattr(row, name) for name in _field_names(type(row))}
    for k in list(out):
        if k in _JSON_FIELDS:
            out[k] = json.dumps(out[k], separators=(",", ":"))
        elif k in _BOOL_FIELDS:
            out[k] = int(out[k])
    return out


def _from_db(cls: type[Any], rec: sqlite3.Row) -> Any:
    data = {}
    names = _field_names(cls)
    for k in rec.keys():
        if k not in names:
            continue
        v = rec[k]
        if k in _JSON_FIELDS:
            v = json.loads(v) if v else ({} if k not in {"lowers", "pinned_layers", "depends_on", "volume_mounts"} else [])
        elif k in _BOOL_FIELDS:
            v = bool(v)
        data[k] = v
    return cls(**data)


class Binder(Protocol):
    """The cluster directory as the store sees it (``aenv.directory.node.NodeDirectory``): a sandbox row
    is bound there before it is written, and unbound after it is deleted. ``bind`` may refuse (the node
    is fenced off): then nothing is written."""

    def bind(self, sandbox_id: str) -> None: ...
    def unbind(self, sandbox_id: str) -> None: ...
    def claim(self, sandbox_ids: list[str]) -> dict[str, str]: ...  # at start: those no longer this node's
    def bind_volume(self, volume_id: str, owner: str, name: str) -> None: ...  # may refuse: Conflict, fenced
    def unbind_volume(self, volume_id: str, owner: str, name: str) -> None: ...
    def claim_volumes(self, volumes: list[tuple[str, str, str]]) -> dict[str, str]: ...  # (id, owner, name)


class Store:
    """The metadata database. One instance per server process; thread-safe via a lock. With a
    ``binder`` (cluster mode) each new sandbox row is bound in the cluster directory in the same step."""

    def __init__(self, path: Path, binder: Binder | None = None) -> None:
        self.path = path
        self.binder = binder
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._templates: dict[str, TemplateRow] = {}  # get_template's answers, see there
        self._templates_version = -1
        try:
            self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA busy_timeout=5000")
            self._db.executescript(_SCHEMA)
            self._migrate()
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open metadata database {path}: {exc}") from exc

    def _migrate(self) -> None:
        """Bring a database of an older schema up to ``SCHEMA_VERSION`` (columns added since)."""
        for table, columns in _ADDED_COLUMNS.items():
            have = {r["name"] for r in self._db.execute(f"PRAGMA table_info({table})")}
            for name, definition in columns:
                if name not in have:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {definition}")
        self._db.execute(
            "INSERT INTO meta(key, value) VALUES ('schema_version', ?) "
            "ON CONFLICT(key) DO UPDATE SET value=excluded.value WHERE CAST(value AS INTEGER) < ?",
            (str(SCHEMA_VERSION), SCHEMA_VERSION),
        )

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                yield self._db
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                self._db.execute("ROLLBACK")
                raise StoreError(f"metadata database error: {exc}") from exc
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def _query(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._lock:
            try:
                return list(self._db.execute(sql, args))
            except sqlite3.Error as exc:
                raise StoreError(f"metadata database error: {exc}") from exc

    # ---- sandboxes ------------------------------------------------------------------------------
    def put_sandbox(self, row: SandboxRow) -> None:
        if self.binder is not None:
            self.binder.bind(row.id)  # first: a fenced node writes nothing
        _put(self, "sandboxes", row)

    def update_sandbox(self, sandbox_id: str, **changes: Any) -> None:
        if not changes:
            return
        data = {}
        for k, v in changes.items():
            if k in _JSON_FIELDS:
                v = json.dumps(v, separators=(",", ":"))
            elif k in _BOOL_FIELDS:
                v = int(v)
            data[k] = v
        sets = ",".join(f"{k}=?" for k in data)
        with self._tx() as db:
            db.execute(f"UPDATE sandboxes SET {sets} WHERE id=?", (*data.values(), sandbox_id))

    def delete_sandbox(self, sandbox_id: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM sandboxes WHERE id=?", (sandbox_id,))
        if self.binder is not None:
            self.binder.unbind(sandbox_id)

    def get_sandbox(self, sandbox_id: str) -> SandboxRow | None:
        rows = self._query("SELECT * FROM sandboxes WHERE id=?", (sandbox_id,))
        return _from_db(SandboxRow, rows[0]) if rows else None

    def list_sandboxes(self) -> list[SandboxRow]:
        return [_from_db(SandboxRow, r) for r in self._query("SELECT * FROM sandboxes ORDER BY started_at")]

    def find_by_idempotency_key(self, key: str) -> SandboxRow | None:
        rows = self._query("SELECT * FROM sandboxes WHERE idempotency_key=?", (key,))
        return _from_db(SandboxRow, rows[0]) if rows else None

    # ---- templates ------------------------------------------------------------------------------
    def put_template(self, row: TemplateRow) -> None:
        data = _to_db(row)
        cols = ",".join(data)
        marks = ",".join("?" for _ in data)
        with self._tx() as db:
            self._templates.clear()
            if row.alias:
                # An alias moves to the newest template that claims it (like a docker tag).
                db.execute("UPDATE templates SET alias=NULL WHERE alias=? AND id<>?", (row.alias, row.id))
            db.execute(f"INSERT OR REPLACE INTO templates({cols}) VALUES ({marks})", tuple(data.values()))

    def get_template(self, id_or_alias: str) -> TemplateRow | None:
        """By ID or alias. Every create asks, so found rows are kept until this store writes or deletes
        a template, or another connection changes the database (``PRAGMA data_version``: e.g. ``aenv
        template build --register`` while the server runs); each caller gets its own copy."""
        with self._lock:
            version = self._db.execute("PRAGMA data_version").fetchone()[0]
            if version != self._templates_version:
                self._templates.clear()
                self._templates_version = version
            cached = self._templates.get(id_or_alias)
            if cached is None:
                rows = self._query(
                    "SELECT * FROM templates WHERE id=? OR alias=? ORDER BY id=? DESC", (id_or_alias,) * 3
                )
                if not rows:
                    return None
                cached = self._templates[id_or_alias] = _from_db(TemplateRow, rows[0])
            return replace(cached)

    def list_templates(self) -> list[TemplateRow]:
        return [_from_db(TemplateRow, r) for r in self._query("SELECT * FROM templates ORDER BY created_at")]

    def set_template_public(self, template_id: str, public: bool) -> None:
        with self._tx() as db:
            self._templates.clear()
            db.execute("UPDATE templates SET public=? WHERE id=?", (int(public), template_id))

    def delete_template(self, template_id: str) -> None:
        with self._tx() as db:
            self._templates.clear()
            db.execute("DELETE FROM templates WHERE id=?", (template_id,))

    # ---- snapshots ------------------------------------------------------------------------------
    def put_snapshot(self, row: SnapshotRow) -> None:
        _put(self, "snapshots", row)

    def update_snapshot(self, snapshot_id: str, **changes: Any) -> None:
        data = {k: (json.dumps(v) if k in _JSON_FIELDS else int(v) if k in _BOOL_FIELDS else v) for k, v in changes.items()}
        sets = ",".join(f"{k}=?" for k in data)
        with self._tx() as db:
            db.execute(f"UPDATE snapshots SET {sets} WHERE id=?", (*data.values(), snapshot_id))

    def get_snapshot(self, id_or_name: str) -> SnapshotRow | None:
        rows = self._query(
            "SELECT * FROM snapshots WHERE id=? OR name=? ORDER BY id=? DESC, created_at DESC", (id_or_name,) * 3
        )
        return _from_db(SnapshotRow, rows[0]) if rows else None

    def list_snapshots(self) -> list[SnapshotRow]:
        return [_from_db(SnapshotRow, r) for r in self._query("SELECT * FROM snapshots ORDER BY created_at")]

    def delete_snapshot(self, snapshot_id: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM snapshots WHERE id=?", (snapshot_id,))


def _put(store: Store, table: str, row: Any) -> None:
    data = _to_db(row)
    cols = ",".join(data)
    marks = ",".join("?" for _ in data)
    with store._tx() as db:
        db.execute(f"INSERT OR REPLACE INTO {table}({cols}) VALUES ({marks})", tuple(data.values()))


def now() -> float:
    return time.time()

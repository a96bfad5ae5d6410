"""The metadata store: rows round-trip (JSON and bool columns), and the template cache never serves a
row that this store or another connection has since changed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.store.sqlite import SandboxRow, Store, TemplateRow
from aenv.store.uid_slots import UidSlots


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(tmp_path / "aenv.db")
    yield s
    s.close()


def template(tid: str, rootfs: str, alias: str | None = None) -> TemplateRow:
    return TemplateRow(id=tid, kind="bootstrap", rootfs=rootfs, cpu_count=2, memory_mb=512, disk_mb=1024,
                       created_at=1.0, alias=alias, lowers=["/l1"], config={"env": {"A": "1"}})


def test_sandbox_row_round_trip(store: Store) -> None:
    row = SandboxRow(id="s1", template_id="base", state="running", runtime="ns", started_at=1.5, end_at=2.5,
                     cpu_count=2, memory_mb=512, disk_mb=1024, auto_resume=True, allow_internet=False,
                     metadata={"k": "v"}, runtime_state={"pid": 7, "lowers": ["/a"]}, depends_on=["snap1"])
    store.put_sandbox(row)
    assert store.get_sandbox("s1") == row
    row.metadata["k"] = "changed after the put"
    assert store.get_sandbox("s1").metadata == {"k": "v"}  # type: ignore[union-attr]


def test_template_lookup_by_id_or_alias_returns_copies(store: Store) -> None:
    store.put_template(template("base-1", "/r1", alias="base"))
    first = store.get_template("base")
    assert first is not None and first.id == "base-1"
    first.rootfs = "/mutated by a caller"
    assert store.get_template("base").rootfs == "/r1"  # type: ignore[union-attr]
    assert store.get_template("base-1").rootfs == "/r1"  # type: ignore[union-attr]
    assert store.get_template("nope") is None


def test_template_cache_follows_own_writes(store: Store) -> None:
    store.put_template(template("base-1", "/r1", alias="base"))
    assert store.get_template("base").id == "base-1"  # type: ignore[union-attr]
    store.put_template(template("base-2", "/r2", alias="base"))  # the alias moves, like a docker tag
    assert store.get_template("base").id == "base-2"  # type: ignore[union-attr]
    assert store.get_template("base-1").alias is None  # type: ignore[union-attr]
    store.delete_template("base-2")
    assert store.get_template("base") is None


def test_template_cache_sees_another_connections_writes(store: Store, tmp_path: Path) -> None:
    assert store.get_template("ci") is None
    store.put_template(template("ci-1", "/old", alias="ci"))
    assert store.get_template("ci").rootfs == "/old"  # type: ignore[union-attr]
    other = Store(tmp_path / "aenv.db")  # e.g. `aenv template build --register` beside the server
    try:
        other.put_template(template("ci-1", "/rebuilt", alias="ci"))
        assert store.get_template("ci").rootfs == "/rebuilt"  # type: ignore[union-attr]
        other.delete_template("ci-1")
        assert store.get_template("ci") is None
    finally:
        other.close()


def test_rows_come_back_with_their_enums_and_refuse_unknown_values(store: Store) -> None:
    import pytest

    from aenv.kinds import SandboxState, SnapshotMode, TemplateKind
    from aenv.store.sqlite import SnapshotRow

    store.put_sandbox(SandboxRow(id="s2", template_id="base", state=SandboxState.PAUSED, runtime="ns", started_at=1.0,
                                 end_at=2.0, cpu_count=1, memory_mb=256, disk_mb=512))
    got = store.get_sandbox("s2")
    assert got is not None and got.state is SandboxState.PAUSED
    store.put_template(template("t-enum", "/r"))
    tpl = store.get_template("t-enum")
    assert tpl is not None and tpl.kind is TemplateKind.BOOTSTRAP
    store.put_snapshot(SnapshotRow(id="p1", template_id="base", runtime="ns", mode="filesystem", state="ready",
                                   created_at=1.0, dir="/d"))
    snap = store.get_snapshot("p1")
    assert snap is not None and snap.mode is SnapshotMode.FILESYSTEM
    with pytest.raises(ValueError):
        SandboxRow(id="x", template_id="base", state="exploded", runtime="ns", started_at=0, end_at=0,  # type: ignore[arg-type]
                   cpu_count=1, memory_mb=1, disk_mb=1)


def test_an_older_database_gains_the_new_columns_and_keeps_its_rows(tmp_path: Path) -> None:
    """A v1 database (before autoPauseMemory and pause modes): opening it adds the columns, the old
    rows read with their defaults, and the new fields round-trip."""
    import sqlite3

    from aenv.kinds import SnapshotMode
    from aenv.store.sqlite import SCHEMA_VERSION

    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript(
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
        "INSERT INTO meta VALUES ('schema_version', '1');"
        "CREATE TABLE sandboxes (id TEXT PRIMARY KEY, template_id TEXT NOT NULL, alias TEXT, state TEXT NOT NULL,"
        " runtime TEXT NOT NULL, started_at REAL NOT NULL, end_at REAL NOT NULL, paused_at REAL,"
        " auto_pause INTEGER NOT NULL DEFAULT 0, auto_resume INTEGER NOT NULL DEFAULT 0,"
        " cpu_count INTEGER NOT NULL, memory_mb INTEGER NOT NULL, disk_mb INTEGER NOT NULL,"
        " allow_internet INTEGER NOT NULL DEFAULT 1, metadata TEXT NOT NULL DEFAULT '{}',"
        " env_vars TEXT NOT NULL DEFAULT '{}', access_token TEXT, runtime_state TEXT NOT NULL DEFAULT '{}',"
        " idempotency_key TEXT, created_seq INTEGER NOT NULL DEFAULT 0, lineage_head TEXT,"
        " depends_on TEXT NOT NULL DEFAULT '[]');"
        "INSERT INTO sandboxes (id, template_id, state, runtime, started_at, end_at, cpu_count, memory_mb, disk_mb)"
        " VALUES ('old1', 'base', 'paused', 'ns', 1.0, 2.0, 1, 256, 512);"
        "CREATE TABLE templates (id TEXT PRIMARY KEY, alias TEXT UNIQUE, kind TEXT NOT NULL, source TEXT,"
        " rootfs TEXT NOT NULL, lowers TEXT NOT NULL DEFAULT '[]', config TEXT NOT NULL DEFAULT '{}',"
        " cpu_count INTEGER NOT NULL, memory_mb INTEGER NOT NULL, disk_mb INTEGER NOT NULL,"
        " size_bytes INTEGER NOT NULL DEFAULT 0, created_at REAL NOT NULL, pinned_layers TEXT NOT NULL DEFAULT '[]');"
        "INSERT INTO templates (id, alias, kind, rootfs, cpu_count, memory_mb, disk_mb, created_at)"
        " VALUES ('t1', 'mine', 'image', '/r', 1, 256, 512, 1.0);"
    )
    db.commit()
    db.close()
    store = Store(path)
    try:
        old = store.get_sandbox("old1")
        assert old is not None and old.auto_pause_memory is True and old.pause_mode is None
        store.update_sandbox("old1", pause_mode=SnapshotMode.FILESYSTEM, auto_pause_memory=False)
        again = store.get_sandbox("old1")
        assert again is not None and again.pause_mode is SnapshotMode.FILESYSTEM and again.auto_pause_memory is False
        assert again.network == {} and again.traffic_token is None  # v3
        store.update_sandbox("old1", network={"denyOut": ["0.0.0.0/0"]}, traffic_token="t")
        third = store.get_sandbox("old1")
        assert third is not None and third.network == {"denyOut": ["0.0.0.0/0"]} and third.traffic_token == "t"
        assert third.has_network is None  # v4: unknown for an older row
        store.update_sandbox("old1", has_network=True)
        fourth = store.get_sandbox("old1")
        assert fourth is not None and fourth.has_network is True
        assert fourth.volume_mounts == []  # v5
        assert fourth.owner == ""  # v6: made before teams: an admin's to see
        template = store.get_template("mine")
        assert template is not None and template.owner == "" and template.public is False
        assert store._query("SELECT count(*) AS n FROM secrets")[0]["n"] == 0  # v6: new tables
        assert store._query("SELECT count(*) AS n FROM egress_cas")[0]["n"] == 0
        version = store._query("SELECT value FROM meta WHERE key='schema_version'")[0]["value"]
        assert int(version) == SCHEMA_VERSION == 7
        assert UidSlots(store).all() == {}  # v7: the uid range slots' table, empty
    finally:
        store.close()
    Store(path).close()  # opening a migrated database again changes nothing

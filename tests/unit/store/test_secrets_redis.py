"""The secrets' two stores against one contract: the node's SQLite (``SecretLog``) and the cluster's Redis
(``RedisSecretLog``, a real redis-server): names unique per owner, another owner's secret never found,
pages by name, updates bump the version, the value only through ``value_of``. Then what only the Redis
one does: two nodes (two logs, two SQLite stores) see the same rows, and an unreachable Redis is a 503
that names no value."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.core.secrets import Secrets
from aenv.errors import Conflict, InvalidRequest, NotFound, StoreUnavailable
from aenv.store.secrets import SecretLog, SecretRow, SecretRows
from aenv.store.secrets_redis import RedisSecretLog
from aenv.store.sqlite import Store
from tests.fixtures.redis import redis_server, redis_url  # noqa: F401

VALUE = "sk-redis-" + "9" * 24


def _row(secret_id: str, owner: str, name: str, at: float = 1.5) -> SecretRow:
    return SecretRow(secret_id, owner, name, 1, at, at, {"env": "t"})


@pytest.fixture(params=["sqlite", "redis"])
def rows(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SecretRows]:
    if request.param == "sqlite":
        store = Store(tmp_path / "aenv.db")
        yield SecretLog(store)
        store.close()
    else:
        log = RedisSecretLog(request.getfixturevalue("redis_url"))
        yield log
        log.close()


def test_the_same_contract(rows: SecretRows) -> None:
    rows.create(_row("sec_1", "team-a", "openai"), VALUE)
    with pytest.raises(Conflict):
        rows.create(_row("sec_2", "team-a", "openai"), "other")
    rows.create(_row("sec_3", "team-b", "openai"), "b's")  # names are per owner
    got = rows.get("team-a", "sec_1")
    assert got == _row("sec_1", "team-a", "openai")
    assert rows.by_name("team-a", "openai") == got
    assert rows.get("team-b", "sec_1") is None and rows.by_name("team-c", "openai") is None
    assert rows.value_of("sec_1") == VALUE and rows.value_of("sec_3") == "b's"

    assert rows.update("team-b", "sec_1", "stolen", None, 2.0) is None  # another owner's: unknown
    upd = rows.update("team-a", "sec_1", VALUE + "2", None, 2.5)
    assert upd is not None and upd.version == 2 and upd.updated_at == 2.5 and upd.metadata == {"env": "t"}
    upd = rows.update("team-a", "sec_1", VALUE + "3", {"k": "v"}, 3.0)
    assert upd is not None and upd.version == 3 and upd.metadata == {"k": "v"} and upd.created_at == 1.5
    assert rows.value_of("sec_1") == VALUE + "3"

    for i, name in enumerate(["b", "a", "c~", "c", "ab"]):
        rows.create(_row(f"sec_p{i}", "team-a", name), "v")
    names = [r.name for r in rows.page("team-a", "", 100)]
    assert names == ["a", "ab", "b", "c", "c~", "openai"]  # byte order, in both stores
    assert [r.name for r in rows.page("team-a", "ab", 2)] == ["b", "c"]
    assert [r.name for r in rows.page("team-a", "c~", 10)] == ["openai"]
    assert [r.name for r in rows.page("team-b", "", 10)] == ["openai"]

    assert not rows.delete("team-b", "sec_1")
    assert rows.delete("team-a", "sec_1")
    assert rows.get("team-a", "sec_1") is None and rows.value_of("sec_1") is None
    assert not rows.delete("team-a", "sec_1")
    rows.create(_row("sec_4", "team-a", "openai"), "again")  # the name is free again
    assert rows.by_name("team-a", "openai") == _row("sec_4", "team-a", "openai")
    assert rows.value_of("sec_3") == "b's"


def test_two_nodes_share_the_rows(tmp_path: Path, redis_url: str) -> None:  # noqa: F811
    stores = [Store(tmp_path / f"n{i}.db") for i in (1, 2)]
    n1, n2 = (Secrets(s, redis_url) for s in stores)
    try:
        made = n1.create("team-a", "OpenAI", VALUE, {"env": "t"})
        assert n2.find("team-a", "openai") == made and n2.find("team-a", made.id) == made
        assert n2.binder("team-a")("OPENAI") == made.id  # a sandbox's rules on node 2 bind node 1's secret
        assert n2.value_of(made.id) == VALUE
        with pytest.raises(Conflict):
            n2.create("team-a", "openai", "x", None)
        with pytest.raises(NotFound) as err:
            n2.find("team-b", made.id)
        assert str(err.value) == f"secret '{made.id}' not found"
        with pytest.raises(InvalidRequest):
            n2.binder("team-b")("openai")
        n2.update("team-a", "openai", VALUE + "2", None)
        assert n1.value_of(made.id) == VALUE + "2" and n1.find("team-a", made.id).version == 2
        assert [r.id for r in n1.page("team-a", "", 10)] == [made.id]
        stores.append(Store(tmp_path / "n3.db"))
        n3 = Secrets(stores[-1], redis_url)  # a node started later
        assert n3.find("team-a", "openai") == n1.find("team-a", "openai")
        n1.delete("team-a", made.id)
        assert n2.value_of(made.id) is None and n2.page("team-a", "", 10) == []
    finally:
        for s in stores:
            s.close()


def test_a_node_warns_of_its_own_secrets_when_it_joins_a_cluster(tmp_path: Path, redis_url: str,  # noqa: F811
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    store = Store(tmp_path / "aenv.db")
    Secrets(store).create("team-a", "old", VALUE, None)
    with caplog.at_level(logging.WARNING, logger="aenv.secrets"):
        joined = Secrets(store, redis_url)
    assert "1 secret(s) in this node's own database are not used" in caplog.text and VALUE not in caplog.text
    assert joined.page("team-a", "", 10) == []
    store.close()


def test_an_unreachable_redis_is_a_503_naming_no_value(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{s.getsockname()[1]}"
    log = RedisSecretLog(url)
    for call in (lambda: log.create(_row("sec_1", "a", "n"), VALUE), lambda: log.value_of("sec_1"),
                 lambda: log.page("a", "", 10), lambda: log.update("a", "sec_1", VALUE, None, 1.0)):
        with pytest.raises(StoreUnavailable) as err:
            call()
        assert "unreachable" in str(err.value) and VALUE not in str(err.value)

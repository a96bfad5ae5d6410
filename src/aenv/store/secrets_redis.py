"""E2B secrets in the cluster's Redis (``cluster_redis``): one set of rows that every node of the cluster
lists, reads and injects, behind the same interface as the node's own ``SecretLog``.

Unlike the directory's bindings (soft state that nodes publish again when they start), these rows are the
only copy: the cluster's Redis keeps them in its append-only file (``cluster/redis_proc.py`` starts it so),
as a node's SQLite would. Keys (names are stored lower case, unique per owner, as in SQLite):

- ``aenv:secret:<id>``: hash ``owner``, ``name``, ``value``, ``version``, ``metadata`` (JSON),
  ``created_at``, ``updated_at``;
- ``aenv:secretname:<owner>``: hash name -> id (the name's uniqueness, and lookups by name);
- ``aenv:secretnames:<owner>``: sorted set of the names, all scored 0, so a page is a lexical range
  (byte order, as SQLite's ``ORDER BY name``).

Every change is one script, so two nodes creating the same name at once get one row and one Conflict.
The value is written here and read back only by :meth:`RedisSecretLog.value_of` (the egress proxy);
no error message carries it. Redis unreachable: a ``StoreUnavailable`` (503), nothing changed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import redis

from aenv.errors import Conflict, StoreUnavailable
from aenv.store.secrets import SecretRow

TAKEN = "TAKEN"
_FIELDS = ("owner", "name", "version", "metadata", "created_at", "updated_at")  # never ``value``
T = TypeVar("T")


def secret_key(secret_id: str) -> str:
    return f"aenv:secret:{secret_id}"


def owner_keys(owner: str) -> list[str]:
    """The owner's names hash and name index (KEYS[2] and KEYS[3] of the scripts that change them)."""
    return [f"aenv:secretname:{owner}", f"aenv:secretnames:{owner}"]


# KEYS: secret hash, owner's names hash, owner's name index. ARGV: id, owner, name, value, version,
# metadata, created_at, updated_at.
_CREATE = """
if redis.call('HEXISTS', KEYS[2], ARGV[3]) == 1 then return redis.error_reply('TAKEN') end
redis.call('HSET', KEYS[1], 'owner', ARGV[2], 'name', ARGV[3], 'value', ARGV[4], 'version', ARGV[5],
  'metadata', ARGV[6], 'created_at', ARGV[7], 'updated_at', ARGV[8])
redis.call('HSET', KEYS[2], ARGV[3], ARGV[1])
redis.call('ZADD', KEYS[3], 0, ARGV[3])
return 1
"""

# KEYS: secret hash. ARGV: owner, value, updated_at, '1' if metadata follows, metadata. 0: not owner's.
_UPDATE = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'value', ARGV[2], 'updated_at', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'version', 1)
if ARGV[4] == '1' then redis.call('HSET', KEYS[1], 'metadata', ARGV[5]) end
return 1
"""

# KEYS: secret hash, owner's names hash, owner's name index. ARGV: owner, id. 0: not owner's.
_DELETE = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
local name = redis.call('HGET', KEYS[1], 'name')
redis.call('DEL', KEYS[1])
if redis.call('HGET', KEYS[2], name) == ARGV[2] then
  redis.call('HDEL', KEYS[2], name)
  redis.call('ZREM', KEYS[3], name)
end
return 1
"""

# KEYS: owner's names hash, owner's name index. ARGV: the range's start ('-' or '(' .. name), limit.
# Each secret's id, then its fields in _FIELDS order (never the value).
_PAGE = """
local out = {}
for _, name in ipairs(redis.call('ZRANGEBYLEX', KEYS[2], ARGV[1], '+', 'LIMIT', 0, tonumber(ARGV[2]))) do
  local id = redis.call('HGET', KEYS[1], name)
  if id then
    table.insert(out, id)
    table.insert(out, redis.call('HMGET', 'aenv:secret:' .. id, 'owner', 'name', 'version', 'metadata',
      'created_at', 'updated_at'))
  end
end
return out
"""


def _row(secret_id: str, values: list[Any]) -> SecretRow | None:
    rec = dict(zip(_FIELDS, values, strict=True))
    if rec["owner"] is None:
        return None  # deleted between the index read and the row read
    return SecretRow(secret_id, str(rec["owner"]), str(rec["name"]), int(rec["version"]), float(rec["created_at"]),
                     float(rec["updated_at"]), json.loads(rec["metadata"] or "{}"))  # fmt: skip


class RedisSecretLog:
    """``SecretLog``'s interface over the cluster's Redis (``url``: ``redis://HOST:PORT`` or ``unix://``)."""

    def __init__(self, url: str) -> None:
        self.client: redis.Redis = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0,
                                                        decode_responses=True)  # fmt: skip
        self._create = self.client.register_script(_CREATE)
        self._update = self.client.register_script(_UPDATE)
        self._delete = self.client.register_script(_DELETE)
        self._page = self.client.register_script(_PAGE)

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn``, a Redis error made a 503 naming ``what`` (never a value: redis-py's messages carry none)."""
        try:
            return fn()
        except redis.ResponseError as exc:
            if str(exc).startswith(TAKEN):
                raise
            raise StoreUnavailable(f"secrets: the cluster's Redis refused to {what}: {exc}") from None
        except redis.RedisError as exc:
            raise StoreUnavailable(f"secrets: the cluster's Redis is unreachable ({what}): "
                                   f"{type(exc).__name__}: {exc}") from None

    def create(self, row: SecretRow, value: str) -> None:
        """Insert a new secret; a name its owner already uses (on any node) is a Conflict."""
        keys = [secret_key(row.id), *owner_keys(row.owner)]
        args: list[str | int] = [row.id, row.owner, row.name, value, row.version, json.dumps(row.metadata), repr(row.created_at),
                repr(row.updated_at)]  # fmt: skip
        try:
            self._call("create a secret", lambda: self._create(keys=keys, args=args))
        except redis.ResponseError:
            raise Conflict(f"a secret named '{row.name}' already exists", secret=row.name) from None

    def update(self, owner: str, secret_id: str, value: str, metadata: dict[str, str] | None,
               at: float) -> SecretRow | None:  # fmt: skip
        """A new value (the next version) and, if given, new metadata; None if ``owner`` has no such secret."""
        meta = ["1", json.dumps(metadata)] if metadata is not None else ["0", ""]
        done = self._call("update a secret", lambda: self._update(keys=[secret_key(secret_id)],
                                                                  args=[owner, value, repr(at), *meta]))
        return self.get(owner, secret_id) if done else None

    def get(self, owner: str, secret_id: str) -> SecretRow | None:
        values = self._call("read a secret", lambda: self.client.hmget(secret_key(secret_id), list(_FIELDS)))
        row = _row(secret_id, list(values))
        return row if row is not None and row.owner == owner else None

    def by_name(self, owner: str, name: str) -> SecretRow | None:
        secret_id = self._call("read a secret", lambda: self.client.hget(owner_keys(owner)[0], name))
        return self.get(owner, str(secret_id)) if secret_id is not None else None

    def page(self, owner: str, after: str, limit: int) -> list[SecretRow]:
        """``owner``'s secrets by name, those after ``after``, at most ``limit``."""
        start = "(" + after if after else "-"
        flat = self._call("list secrets", lambda: self._page(keys=owner_keys(owner),
                                                             args=[start, limit]))
        rows = (_row(str(flat[i]), list(flat[i + 1])) for i in range(0, len(flat), 2))
        return [r for r in rows if r is not None]

    def delete(self, owner: str, secret_id: str) -> bool:
        keys = [secret_key(secret_id), *owner_keys(owner)]
        return bool(self._call("delete a secret", lambda: self._delete(keys=keys, args=[owner, secret_id])))

    def value_of(self, secret_id: str) -> str | None:
        """The current value: for the egress proxy only (the sandbox's rules were bound to this ID)."""
        got = self._call("read a secret's value", lambda: self.client.hget(secret_key(secret_id), "value"))
        return str(got) if got is not None else None

    def close(self) -> None:
        self.client.close()

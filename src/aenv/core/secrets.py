"""E2B secrets (``/secrets``): write-only values an owner stores, which the egress proxy puts into a
sandbox's requests where its ``network.rules`` name them (``${e2b.secrets.<name>}`` in a header value).

A secret is addressed by its ID (``sec_…``) or its name, always within one owner: another owner's
secret answers exactly as an unknown one. Values are checked here (they become HTTP header values:
no CR, LF or NUL) and never leave the store except into the egress proxy's requests: not into logs,
API answers, sandboxes or snapshots.
"""

from __future__ import annotations

import logging
import re
import secrets as _random
import time
from collections.abc import Callable

from aenv.errors import InvalidRequest, NotFound
from aenv.store.secrets import SecretLog, SecretRow, SecretRows
from aenv.store.sqlite import Store

log = logging.getLogger("aenv.secrets")

ID_PREFIX = "sec_"
MAX_NAME = 256
MAX_VALUE = 16 * 1024
MAX_META_ENTRIES, MAX_META_KEY, MAX_META_VALUE, MAX_META_TOTAL = 32, 128, 1024, 8192
MAX_PAGE = 100
_BAD_NAME = re.compile(r"[{}\x00-\x1f\x7f-\x9f]")  # as the SDK's Secret.fill: the name goes into ${...}
_BAD_VALUE = re.compile(r"[\r\n\x00]")


class SecretNotFound(NotFound):
    def __init__(self, ref: str) -> None:
        super().__init__(f"secret '{ref}' not found", secret=ref)


def canonical_name(name: str) -> str:
    """The stored form of a name (lower case), or a 400 saying why it cannot be one."""
    if not name or len(name) > MAX_NAME or _BAD_NAME.search(name) or name != name.strip():
        raise InvalidRequest(f"name: 1-{MAX_NAME} characters, no '{{', '}}', control characters or "
                             "surrounding spaces (it is used in the ${e2b.secrets.<name>} placeholder)")
    name = name.lower()
    if name.startswith(ID_PREFIX):
        raise InvalidRequest(f"name: the '{ID_PREFIX}' prefix is reserved for secret IDs")
    return name


def check_value(value: str) -> None:
    """A value must fit an HTTP header (the proxy sends it as one). The message never repeats it."""
    if not value or len(value.encode()) > MAX_VALUE:
        raise InvalidRequest(f"value: 1 to {MAX_VALUE} bytes")
    if _BAD_VALUE.search(value):
        raise InvalidRequest("value: must not contain CR, LF or NUL (it is sent as an HTTP header value)")


def check_metadata(meta: dict[str, str]) -> None:
    if len(meta) > MAX_META_ENTRIES:
        raise InvalidRequest(f"metadata: at most {MAX_META_ENTRIES} entries")
    total = 0
    for k, v in meta.items():
        if not k or len(k.encode()) > MAX_META_KEY:
            raise InvalidRequest(f"metadata: keys are 1-{MAX_META_KEY} bytes")
        if len(v.encode()) > MAX_META_VALUE:
            raise InvalidRequest(f"metadata[{k!r}]: values are at most {MAX_META_VALUE} bytes")
        total += len(k.encode()) + len(v.encode())
    if total > MAX_META_TOTAL:
        raise InvalidRequest(f"metadata: at most {MAX_META_TOTAL} bytes in all")


class Secrets:
    """The secrets of every owner: in the store's ``secrets`` table, or with ``cluster_redis`` in the
    cluster's Redis, so that every node of the cluster lists the same secrets and its egress proxies put
    the same values into the requests of sandboxes wherever they run."""

    def __init__(self, store: Store, cluster_redis: str | None = None) -> None:
        self.log: SecretRows
        if cluster_redis:
            from aenv.store.secrets_redis import RedisSecretLog

            self.log = RedisSecretLog(cluster_redis)
            if left := SecretLog(store).count():  # made before the node joined a cluster
                log.warning("%d secret(s) in this node's own database are not used in cluster mode (the "
                            "cluster's Redis holds the secrets): create them again through the API", left)
        else:
            self.log = SecretLog(store)

    def create(self, owner: str, name: str, value: str, metadata: dict[str, str] | None) -> SecretRow:
        name = canonical_name(name)
        check_value(value)
        check_metadata(metadata or {})
        now = time.time()
        row = SecretRow(ID_PREFIX + _random.token_hex(12), owner, name, 1, now, now, dict(metadata or {}))
        self.log.create(row, value)
        return row

    def find(self, owner: str, ref: str) -> SecretRow:
        """By ID or (case-insensitive) name, within ``owner``'s."""
        row = self.log.get(owner, ref) if ref.startswith(ID_PREFIX) else self.log.by_name(owner, ref.lower())
        if row is None:
            raise SecretNotFound(ref)
        return row

    def update(self, owner: str, ref: str, value: str, metadata: dict[str, str] | None) -> SecretRow:
        check_value(value)
        if metadata is not None:
            check_metadata(metadata)
        row = self.log.update(owner, self.find(owner, ref).id, value, metadata, time.time())
        if row is None:  # deleted in between
            raise SecretNotFound(ref)
        return row

    def delete(self, owner: str, ref: str) -> None:
        if not self.log.delete(owner, self.find(owner, ref).id):
            raise SecretNotFound(ref)

    def page(self, owner: str, after: str, limit: int) -> list[SecretRow]:
        return self.log.page(owner, after, max(1, min(limit, MAX_PAGE)))

    def value_of(self, secret_id: str) -> str | None:
        return self.log.value_of(secret_id)

    def binder(self, owner: str) -> Callable[[str], str]:
        """Secret name -> ID within ``owner``'s, for a sandbox's header rules (``runtime/egress_rules.py``):
        an unknown name is a 400 of the request that names it."""

        def bind(name: str) -> str:
            try:
                return self.find(owner, name).id
            except SecretNotFound:
                raise InvalidRequest(f"network.rules: secret '{name}' not found (create it with "
                                     "POST /secrets, Secret.create, first)") from None

        return bind

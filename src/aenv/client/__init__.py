"""A small Python client for aenv's own API (snapshots, fork, rollback), for code that wants more than
the E2B SDK offers::

    from aenv.client import AenvClient

    with AenvClient("http://127.0.0.1:8000", api_key) as c:
        snap = c.snapshot(sandbox_id, mode="filesystem")
        fork = c.fork(sandbox_id, count=16)      # fork.mode says what was copied
        c.rollback(sandbox_id, snap.snapshot_id)
        lease = c.create_lease(ttl=30)          # heartbeat it; sandboxes tagged with it end with it
"""

from aenv.client._client import AenvClient, ForkResult, Snapshot
from aenv.client._errors import (
    AenvClientError,
    ApiError,
    ConflictError,
    GoneError,
    NotFoundError,
    ServerUnreachable,
)

__all__ = [
    "AenvClient",
    "AenvClientError",
    "ApiError",
    "ConflictError",
    "ForkResult",
    "GoneError",
    "NotFoundError",
    "ServerUnreachable",
    "Snapshot",
]

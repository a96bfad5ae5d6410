"""A heartbeat lease held by the trainer process: if the process dies, its sandboxes die ``ttl`` later.

``with Lease(ttl=30, name="run7") as lease:`` takes a lease on the server (``POST /aenv/leases``) and
heartbeats it from a daemon thread every ``ttl / 3`` seconds; episodes and groups given ``lease=``
tag their sandboxes with it (metadata ``aenv.lease``; fork children inherit the tag). One heartbeat
covers every sandbox of the process, however many: no per-sandbox keepalive has to outlive a crash,
a ``kill -9`` or a lost node of the trainer. Leaving the block ends the lease and kills what is left
(``end=False`` keeps it, e.g. to hand it to another process, which then heartbeats it by ID).
"""

from __future__ import annotations

import threading
from typing import Any, Self

from aenv.client import GoneError
from aenv.rl._connection import client as _client

LEASE_KEY = "aenv.lease"


class Lease:
    def __init__(self, ttl: float = 30.0, *, name: str = "", lease_id: str | None = None, end: bool = True,
                 **connection: Any) -> None:
        self.ttl, self.name, self.end_on_exit = ttl, name, end
        self.lease_id = lease_id  # given: heartbeat an existing lease instead of taking a new one
        self.connection = connection  # api_url / api_key as the E2B SDK takes them
        self.heartbeats = 0
        self.error: str | None = None  # the last heartbeat failure, if any (a GoneError: the lease ended)
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    @property
    def metadata(self) -> dict[str, str]:
        """The tag that binds a sandbox to this lease (merge it into ``Sandbox.create(metadata=...)``)."""
        if self.lease_id is None:
            raise RuntimeError("the lease is not taken yet: use it inside its `with` block")
        return {LEASE_KEY: self.lease_id}

    def __enter__(self) -> Self:
        if self.lease_id is None:
            with _client(self.connection) as c:
                self.lease_id = str(c.create_lease(self.ttl, self.name)["leaseID"])
        self._beat = threading.Thread(target=self._heartbeat, name=f"aenv-rl-lease-{self.lease_id}", daemon=True)
        self._beat.start()
        return self

    def _heartbeat(self) -> None:
        assert self.lease_id is not None
        with _client(self.connection) as c:
            while not self._stop.wait(max(0.2, self.ttl / 3)):
                try:
                    c.heartbeat(self.lease_id)
                    self.heartbeats += 1
                    self.error = None
                except GoneError as exc:
                    self.error = str(exc)
                    return  # ended: nothing left to keep alive
                except Exception as exc:  # noqa: BLE001 - a missed beat is retried; ttl / 3 leaves two more
                    self.error = f"{type(exc).__name__}: {exc}"

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        if self.end_on_exit and self.lease_id is not None:
            with _client(self.connection) as c:
                try:
                    c.end_lease(self.lease_id)
                except GoneError:
                    pass

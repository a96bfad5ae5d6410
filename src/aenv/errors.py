"""The one exception tree of aenv, shared by every layer: each raises these; only ``api/errors.py``
maps them to E2B-shaped HTTP errors, and nothing here knows about HTTP.

    AenvError
    ├── NotFound                 sandbox, template or snapshot does not exist
    │   ├── SandboxNotFound
    │   │   └── SandboxGone      it existed and ended (killed, expired, reaped, lease lost, lost): 404, or 410 if asked
    │   ├── TemplateNotFound
    │   └── SnapshotNotFound
    ├── Gone                     an aenv-only object that existed and ended (a heartbeat lease): 410
    ├── InvalidRequest           input that passed schema validation but makes no sense
    ├── StateError               action not allowed in the current lifecycle state (e.g. pause a paused sandbox)
    ├── Conflict                 a concurrent transition owns the object (e.g. killing)
    │   └── MachineMismatch      saved VM state taken on another machine (CPU model, QEMU): 409 reason machine
    ├── CapacityError            admission control refused: too many sandboxes or starts at once
    ├── RuntimeFailure           the runtime could not do what was asked (spawn, mount, QEMU, ...)
    │   └── SandboxUnreachable   the sandbox runs but its agent/envd did not answer
    │       ├── PortNotOpen      the sandbox runs but nothing listens on the requested port
    │       └── GuestUnresponsive  a pause that needs envd's answer did not get it (the sandbox runs on)
    ├── ImageError               anything from the image pipeline (see aenv.images.errors)
    └── StoreError               metadata persistence failed
        └── StoreUnavailable     a store the server needs is unreachable for now (the cluster directory): 503, retry
"""

from __future__ import annotations

from typing import Any


class AenvError(Exception):
    """Root of aenv's errors. ``context`` carries IDs and states for logs and messages."""

    def __init__(self, message: str, **context: Any) -> None:
        super().__init__(message)
        self.message = message
        self.context = context

    def __str__(self) -> str:
        return self.message


class NotFound(AenvError):
    pass


class SandboxNotFound(NotFound):
    def __init__(self, sandbox_id: str) -> None:
        super().__init__(f"sandbox '{sandbox_id}' not found", sandbox_id=sandbox_id)


class SandboxGone(SandboxNotFound):
    """A sandbox that existed and ended: the E2B SDKs see their 404 (``NotFoundException``) with the
    reason in the message; a client that asks (``Prefer: aenv-gone=410``) gets a 410."""

    def __init__(self, sandbox_id: str, reason: str, detail: str, at: str) -> None:
        super().__init__(sandbox_id)
        self.message = f"sandbox '{sandbox_id}' not found: it ended at {at} ({reason}: {detail})"
        self.reason = reason
        self.detail = detail
        self.at = at
        self.context.update(reason=reason)


class Gone(AenvError):
    """An object of aenv's own API (no E2B client expects a 404 for it) that existed and ended."""


class TemplateNotFound(NotFound):
    def __init__(self, template: str) -> None:
        super().__init__(f"template '{template}' not found", template=template)


class SnapshotNotFound(NotFound):
    def __init__(self, snapshot_id: str) -> None:
        super().__init__(f"snapshot '{snapshot_id}' not found", snapshot_id=snapshot_id)


class InvalidRequest(AenvError):
    pass


class StateError(AenvError):
    pass


class Conflict(AenvError):
    pass


class MachineMismatch(Conflict):
    """A saved VM state (snapshot, pause) cannot be restored here: it was taken on another machine
    (``aenv.machine_key``: accelerator, CPU model, QEMU). Raised before anything starts; both records
    travel to the client, so a gateway can send it to a node that matches."""

    def __init__(self, message: str, recorded: dict[str, str], here: dict[str, str] | None, **context: Any) -> None:
        super().__init__(message, **context)
        self.recorded = recorded
        self.here = here


class CapacityError(AenvError):
    """Not now, maybe later: ``reason`` says why (``capacity``: the node is busy or full; ``quota``:
    the API key holds its quota; ``restoring``: what it needs is being restored), ``retry_after`` when."""

    def __init__(self, message: str, retry_after: float = 1.0, reason: str = "capacity", **context: Any) -> None:
        super().__init__(message, **context)
        self.retry_after = retry_after
        self.reason = reason


class QuotaExceeded(CapacityError):
    """A team's quota (``aenv/teams.py``) refuses the request: ``quota`` names the limit, ``limit`` its value.
    A 429 while a kill could make room, a 403 (``hard``) when the request alone is larger than the limit."""

    def __init__(self, message: str, quota: str, limit: float, *, hard: bool = False, retry_after: float = 5.0) -> None:
        super().__init__(message, retry_after=retry_after, reason="quota")
        self.quota = quota
        self.limit = limit
        self.hard = hard


class RuntimeFailure(AenvError):
    pass


class SandboxUnreachable(RuntimeFailure):
    pass


class PortNotOpen(SandboxUnreachable):
    pass


class GuestUnresponsive(SandboxUnreachable):
    pass


class ImageError(AenvError):
    pass


class StoreError(AenvError):
    pass


class StoreUnavailable(StoreError):
    """Nothing was changed and nothing is wrong with the request: it may succeed once the store answers."""

    def __init__(self, message: str, retry_after: float = 2.0, **context: Any) -> None:
        super().__init__(message, **context)
        self.retry_after = retry_after

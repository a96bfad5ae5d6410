"""Domain types of the orchestrator: lifecycle states and validated requests.

These are plain dataclasses; ``api/`` converts E2B-shaped JSON into them and back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aenv.errors import StateError
from aenv.kinds import SandboxState

__all__ = ["CreateRequest", "ListQuery", "MountRequest", "NetworkRequest", "SandboxState", "require_state"]


def require_state(sandbox_id: str, current: SandboxState, *allowed: SandboxState, action: str) -> None:
    """Guard for a transition; the error says what state the sandbox is in and what would be needed."""
    if current not in allowed:
        wanted = " or ".join(s.value for s in allowed)
        raise StateError(
            f"cannot {action} sandbox '{sandbox_id}': it is {current.value} (needs {wanted})",
            sandbox_id=sandbox_id,
            state=current.value,
        )


@dataclass(frozen=True)
class NetworkRequest:
    """The ``network`` of a create, or the body of ``PUT /sandboxes/{id}/network`` (then without
    allowPublicTraffic and maskRequestHost); validated and enforced by ``network.py``."""

    allow_out: list[str] | None = None
    deny_out: list[str] | None = None
    dns_servers: list[str] | None = None
    allow_public_traffic: bool | None = None
    mask_request_host: str | None = None
    rules: Any = None  # E2B's header rules, as sent (runtime/egress_rules.py validates them)


@dataclass(frozen=True)
class MountRequest:
    """One of a create's E2B ``volumeMounts``, checked (``volumes.parse_mounts``)."""

    name: str  # the volume's name (E2B mounts by name), without a ``:ro`` suffix
    path: str  # absolute, normalised
    read_only: bool = False


@dataclass(frozen=True)
class BandwidthRequest:
    """aenv's ``bandwidth`` of a create, Mbit/s: None = the server's default, 0 = unlimited
    (checked against the operator's maximum in ``core/network.py``)."""

    egress_mbit: float | None = None
    ingress_mbit: float | None = None


@dataclass(frozen=True)
class CreateRequest:
    template: str
    timeout: int | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    auto_pause: bool = False
    auto_pause_memory: bool = True  # the expiry pause keeps memory (False: files only)
    auto_resume: bool = False
    allow_internet: bool = True
    secure: bool = True
    cpu_count: int | None = None
    memory_mb: int | None = None
    idempotency_key: str | None = None
    network: NetworkRequest | None = None  # E2B's network settings (core/network.py)
    owner: str = ""  # the team it belongs to, whose quota it counts for and whose secrets its rules name
    admin: bool = False  # made with an admin key: any team's template may be its start
    volume_mounts: tuple[MountRequest, ...] = ()  # E2B volumeMounts (core/volumes.py)
    bandwidth: BandwidthRequest | None = None  # aenv's per-sandbox limits (core/network.py)


@dataclass(frozen=True)
class ListQuery:
    states: frozenset[SandboxState] = frozenset({SandboxState.RUNNING, SandboxState.PAUSED})
    metadata: dict[str, str] = field(default_factory=dict)
    template: str | None = None
    started_after: float | None = None
    descending: bool = True
    limit: int = 100
    after: str | None = None  # cursor: the last sandbox ID of the previous page
    owner: str | None = None  # one team's sandboxes only; None: every team's (an admin's list)

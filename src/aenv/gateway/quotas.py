"""Team quotas across the nodes behind a gateway.

Each node enforces a team's quota on what it holds itself, exactly (``core/admission.py``). Behind a
gateway a team's sandboxes spread over the nodes, so the gateway checks the team's total before it places
a create: what every live node last reported the team holds (``/aenv/info`` → ``teams``, read by the
probes about once a second), plus the creates this gateway relayed since those reports. The total is a
second stale at most and counts only this gateway's own recent creates, so it can let a few creates too
many through in a burst across gateways; each node's own check still holds exactly. ``creates_per_second``
is a token bucket per team in the gateway itself (one gateway: exact; N gateways: N times the rate).
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi.responses import JSONResponse

from aenv.api.errors import error_response
from aenv.gateway.nodes import Node
from aenv.teams import Quota, TeamDirectory


@dataclass
class Held:
    sandboxes: int = 0
    vcpus: int = 0
    memory_mb: int = 0


def held_by(team: str, nodes: list[Node]) -> Held:
    """What ``team`` holds on ``nodes`` by their last reports, plus this gateway's creates since."""
    out = Held()
    for node in nodes:
        used = node.teams.get(team) or {}
        out.sandboxes += int(used.get("sandboxes", 0)) + node.placed_by_team.get(team, 0)
        out.vcpus += int(used.get("vcpus", 0))
        out.memory_mb += int(used.get("memoryMB", 0))
    return out


def refusal(quota: str, limit: float, message: str) -> JSONResponse:
    """The same answer a node gives (``api/errors.py`` for ``QuotaExceeded``)."""
    return error_response(429, message, {"Retry-After": "5"}, reason="quota", quota=quota, limit=limit)


def check(teams: TeamDirectory, team: str, nodes: list[Node]) -> JSONResponse | None:
    """A 429 when ``team`` holds its whole quota across ``nodes`` already, else None."""
    quota: Quota = teams.quota(team)
    if quota.max_sandboxes is None and quota.max_vcpus is None and quota.max_memory_mb is None:
        return None
    held = held_by(team, nodes)
    for name, limit, have, unit in (
        ("max_sandboxes", quota.max_sandboxes, held.sandboxes, "sandboxes"),
        ("max_vcpus", quota.max_vcpus, held.vcpus, "vCPUs"),
        ("max_memory_mb", quota.max_memory_mb, held.memory_mb, "MiB of memory"),
    ):
        if limit is not None and have >= limit:
            return refusal(name, limit, f"team quota {name} = {limit} reached: the team holds {have} {unit} across "
                                        "the nodes; kill or pause-to-disk some first")  # fmt: skip
    return None

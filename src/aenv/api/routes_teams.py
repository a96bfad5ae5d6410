"""``GET /aenv/teams``: each team's quota and what it holds on this node (``aenv teams`` shows it).

A team's key sees its own team; an admin key sees every team the server knows (configured, or holding
sandboxes). The same numbers are on ``/metrics`` (``aenv_team_*``), labelled as :func:`aenv.teams.label`
shows a team (a key that is a team of its own by a short prefix of its digest, never the key).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from aenv.api.auth import principal, require_api_key
from aenv.core.admission import Admission, Usage
from aenv.teams import label

router = APIRouter(dependencies=[Depends(require_api_key)])

_LIMITS = ("max_sandboxes", "max_vcpus", "max_memory_mb", "creates_per_second", "max_disk_mb")


def _team_json(adm: Admission, team: str, used: Usage) -> dict[str, Any]:
    quota = adm.quota(team)
    return {
        "team": label(team),
        "usage": {"sandboxes": used.sandboxes, "vcpus": used.vcpus, "memoryMB": used.memory_mb},
        "quota": {k: getattr(quota, k) for k in _LIMITS},
        "refused": {q: n for (t, q), n in adm.refusals.items() if t == team},
    }


@router.get("/aenv/teams")
async def teams(request: Request) -> JSONResponse:
    adm: Admission = request.app.state.orchestrator.admission
    who = principal(request)
    usage = adm.usage_by_team()
    names = sorted(set(adm.teams.teams()) | set(usage)) if who.admin else [who.team]
    return JSONResponse([_team_json(adm, t, usage.get(t, Usage())) for t in names])


def team_metrics(adm: Admission) -> list[str]:
    """Prometheus lines: per team, what it holds, its limits and how often each refused a request."""
    usage = adm.usage_by_team()
    names = sorted(set(adm.teams.teams()) | set(usage))
    lines = ["# HELP aenv_team_sandboxes Sandboxes a team holds on this node", "# TYPE aenv_team_sandboxes gauge"]
    for t in names:
        used = usage.get(t, Usage())
        lines.append(f'aenv_team_sandboxes{{team="{label(t)}"}} {used.sandboxes}')
    lines.append("# TYPE aenv_team_vcpus gauge")
    lines += [f'aenv_team_vcpus{{team="{label(t)}"}} {usage.get(t, Usage()).vcpus}' for t in names]
    lines.append("# TYPE aenv_team_memory_mb gauge")
    lines += [f'aenv_team_memory_mb{{team="{label(t)}"}} {usage.get(t, Usage()).memory_mb}' for t in names]
    lines += ["# HELP aenv_team_quota A team's limit (absent: unlimited)", "# TYPE aenv_team_quota gauge"]
    for t in names:
        quota = adm.quota(t)
        lines += [f'aenv_team_quota{{team="{label(t)}",quota="{k}"}} {getattr(quota, k):g}'
                  for k in _LIMITS if getattr(quota, k) is not None]
    lines.append("# TYPE aenv_team_refusals_total counter")
    lines += [f'aenv_team_refusals_total{{team="{label(t)}",quota="{q}"}} {n}'
              for (t, q), n in sorted(adm.refusals.items())]
    return lines

"""Read routes for the console's operations pages (runs, builds) that the public API has no JSON for.

* ``GET /aenv/runs`` — each run's lifecycle and refusal counters (what ``/metrics`` exports as
  ``aenv_run_*``, which is one scrape for every team), for the request's team only.
* ``GET /aenv/builds?templateID=`` — the team's template builds (newest first): status, steps, when,
  and how many log lines, so the console can list a template's builds; E2B's ``GET /templates/{id}``
  has no build list here (a built tag is its own template row).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse

from aenv.api import tenancy
from aenv.api.auth import principal, require_api_key
from aenv.api.deps import orchestrator
from aenv.core.builds import BuildRecord
from aenv.core.orchestrator import Orchestrator
from aenv.core.run_metrics import RunMetrics

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.get("/aenv/runs")
async def runs(request: Request) -> JSONResponse:
    metrics: RunMetrics = request.app.state.run_metrics
    return JSONResponse({"runKey": metrics.run_key, "runs": metrics.counters(tenancy.list_owner(request))})


@router.get("/aenv/builds")
async def builds(request: Request, orch: Orchestrator = Depends(orchestrator),
                 templateID: str | None = Query(None, max_length=256)) -> JSONResponse:  # noqa: N803 - E2B's casing
    who = principal(request)
    recs = [r for r in orch.builds.records()
            if who.sees(r.owner) and (templateID is None or templateID in (r.template_id, r.alias))]  # fmt: skip
    out = [build_json(r) for r in recs]
    out.sort(key=lambda b: b["startedAt"] or "", reverse=True)
    return JSONResponse(out)


def build_json(rec: BuildRecord) -> dict[str, Any]:
    """One build as the console lists it (its log is read with the E2B status route, by offset)."""
    spec: dict[str, Any] = {}
    if rec.spec_key:
        try:
            spec = json.loads(rec.spec_key)
        except ValueError:
            spec = {}
    steps = [{"type": s[0], "args": s[1], "force": bool(s[3])} for s in spec.get("steps") or [] if len(s) == 4]
    return {
        "templateID": rec.template_id, "buildID": rec.build_id, "alias": rec.alias, "tags": rec.tags,
        "status": rec.status, "startedAt": rec.logs[0]["timestamp"] if rec.logs else None,
        "fromImage": spec.get("fromImage"), "fromTemplate": spec.get("fromTemplate"), "steps": steps,
        "logCount": len(rec.logs), "reason": (rec.reason or {}).get("message"),
    }  # fmt: skip

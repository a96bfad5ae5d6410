"""aenv's routes for many sandboxes at once (under ``/aenv/``): reaping everything one run tagged.

``POST /aenv/sandboxes/kill`` with ``{"metadata": {"run": "X"}}``, or ``DELETE /aenv/sandboxes?metadata=run%3DX``
(the list route's filter encoding), kills every sandbox whose metadata has all those pairs and
answers which it killed and which it could not. An empty filter is refused: a typo must never
kill every sandbox of the server.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from aenv.api import tenancy
from aenv.api.auth import require_api_key
from aenv.api.deps import orchestrator
from aenv.api.routes_sandboxes import parse_metadata_filter
from aenv.core.orchestrator import Orchestrator
from aenv.errors import InvalidRequest

router = APIRouter(dependencies=[Depends(require_api_key)])


class KillFilter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    metadata: dict[str, str]


async def _kill(metadata: dict[str, str], orch: Orchestrator, request: Request) -> JSONResponse:
    if not metadata:
        raise InvalidRequest("metadata: give at least one key=value pair (an empty filter would match every sandbox)")
    report = await orch.kill_matching(metadata, owner=tenancy.list_owner(request))  # the team's own only
    return JSONResponse({
        "killed": report.killed,
        "failed": [{"sandboxID": sid, "message": why} for sid, why in report.failed],
    })


@router.post("/aenv/sandboxes/kill")
async def kill_by_metadata(body: KillFilter, request: Request, orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:
    return await _kill(body.metadata, orch, request)


@router.delete("/aenv/sandboxes")
async def delete_by_metadata(request: Request, metadata: str | None = None,
                             orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:
    return await _kill(parse_metadata_filter(metadata), orch, request)

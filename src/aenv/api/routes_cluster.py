"""A node's cluster-only routes (``aenv serve --cluster-redis`` with a ``snapshot_store``), for the gateway.

``POST /aenv/sandboxes/{id}/adopt`` runs here a sandbox that was lost with its node and whose pause was
published (``core/handover.py``), under the same id and envd token; the body and the answer are E2B
connect's (201: resumed). Authenticated like every route. Without cluster mode or a store: 404.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from aenv.api import serialize, tenancy
from aenv.api.auth import require_api_key
from aenv.api.models import ConnectBody
from aenv.core.handover import PauseHandover
from aenv.errors import NotFound

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/aenv/sandboxes/{sandbox_id}/adopt")
async def adopt(request: Request, sandbox_id: str, body: ConnectBody | None = None) -> JSONResponse:
    handover: PauseHandover | None = getattr(request.app.state, "handover", None)
    if handover is None:
        raise NotFound("this node adopts no sandboxes: it runs without a cluster directory or a snapshot store")
    body = body or ConnectBody()
    body.refuse_unsupported()
    sbx, resumed = await handover.adopt(sandbox_id, body.timeout, tenancy.list_owner(request))
    return JSONResponse(serialize.sandbox(sbx), status_code=201 if resumed else 200)

"""``GET /aenv/webhooks``: the lifecycle webhooks' receivers and delivery log (``core/webhooks.py``), so an
operator can see what was delivered, what is being retried and why, and what failed for good."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse

from aenv.api import tenancy
from aenv.api.auth import require_api_key
from aenv.core.webhooks import EVENTS, Webhooks
from aenv.errors import InvalidRequest
from aenv.store.webhook_log import DELIVERED, FAILED, PENDING

# The receivers are the operator's setting and the deliveries carry every team's events: operators' routes.
router = APIRouter(dependencies=[Depends(require_api_key), Depends(tenancy.require_admin)])


def _webhooks(request: Request) -> Webhooks:
    hooks: Webhooks = request.app.state.webhooks
    return hooks


@router.get("/aenv/webhooks")
async def webhooks(request: Request) -> JSONResponse:
    hooks = _webhooks(request)
    return JSONResponse({"urls": hooks.urls, "signed": bool(hooks.secret), "events": list(EVENTS),
                         "attempts": hooks.attempts})  # fmt: skip


@router.get("/aenv/webhooks/deliveries")
async def deliveries(request: Request, state: str | None = None, limit: int = Query(100, ge=1, le=1000)) -> JSONResponse:
    if state is not None and state not in (PENDING, DELIVERED, FAILED):
        raise InvalidRequest(f"state: one of {PENDING}, {DELIVERED}, {FAILED}")
    return JSONResponse(_webhooks(request).deliveries(state, limit))

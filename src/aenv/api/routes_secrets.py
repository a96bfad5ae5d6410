"""E2B's team secrets API (``/secrets``, e2b >= 2.6x): not served by this server yet. Every route
answers a 400 that says so, rather than a 404 a client would read as "no such secret"."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from aenv.api.auth import require_api_key
from aenv.errors import InvalidRequest

router = APIRouter(dependencies=[Depends(require_api_key)])

NOT_SERVED = ("the secrets API (/secrets) is not implemented by this aenv server: secrets cannot be stored "
              "or injected into sandbox traffic here yet")


@router.get("/secrets")
@router.post("/secrets")
@router.get("/secrets/{secret_id}")
@router.post("/secrets/{secret_id}")
@router.delete("/secrets/{secret_id}")
async def secrets_not_served() -> None:
    raise InvalidRequest(NOT_SERVED)

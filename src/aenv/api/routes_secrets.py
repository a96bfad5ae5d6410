"""E2B's secrets API (``/secrets``, e2b >= 2.6x), thin over ``core/secrets.py``. Values are write-only:
every answer is the secret's metadata (``Secret``: secretID, name, currentVersion, metadata, createdAt,
updatedAt). A secret is addressed by ID or name within its owner's; another owner's answers as an
unknown one (404). A listing pages by name, the next page's token in ``x-next-token``."""

from __future__ import annotations

import base64
import binascii

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse

from aenv.api import serialize, tenancy
from aenv.api.auth import require_api_key
from aenv.api.deps import orchestrator
from aenv.api.models import NewSecret, SecretUpdate
from aenv.core.orchestrator import Orchestrator
from aenv.core.secrets import MAX_PAGE
from aenv.errors import InvalidRequest

router = APIRouter(dependencies=[Depends(require_api_key)])


def secret_owner(request: Request) -> str:
    """Whose secrets a request sees: its team's (an admin key's too: values are write-only and a
    team's secrets are for its own sandboxes' rules, so no key reads or changes another team's)."""
    return tenancy.owner(request)


def _after(token: str | None) -> str:
    if not token:
        return ""
    try:
        return base64.b64decode(token.encode() + b"=" * (-len(token) % 4), altchars=b"-_", validate=True).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise InvalidRequest("nextToken: not a token this server gave") from None


@router.post("/secrets", status_code=201)
async def create_secret(request: Request, body: NewSecret, orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:
    body.refuse_unsupported()
    row = orch.secrets.create(secret_owner(request), body.name, body.value, body.metadata)
    return JSONResponse(serialize.secret(row), status_code=201)


@router.get("/secrets")
async def list_secrets(request: Request, orch: Orchestrator = Depends(orchestrator),
                       limit: int = Query(MAX_PAGE, ge=1, le=MAX_PAGE), nextToken: str | None = None) -> JSONResponse:
    rows = orch.secrets.page(secret_owner(request), _after(nextToken), limit + 1)
    headers = {}
    if len(rows) > limit:
        rows = rows[:limit]
        headers["x-next-token"] = base64.urlsafe_b64encode(rows[-1].name.encode()).decode().rstrip("=")
    return JSONResponse([serialize.secret(r) for r in rows], headers=headers)


@router.get("/secrets/{secret_id}")
async def get_secret(request: Request, secret_id: str, orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:
    return JSONResponse(serialize.secret(orch.secrets.find(secret_owner(request), secret_id)))


@router.post("/secrets/{secret_id}")
async def update_secret(request: Request, secret_id: str, body: SecretUpdate,
                        orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:
    body.refuse_unsupported()
    row = orch.secrets.update(secret_owner(request), secret_id, body.value, body.metadata)
    return JSONResponse(serialize.secret(row))


@router.delete("/secrets/{secret_id}", status_code=204)
async def delete_secret(request: Request, secret_id: str, orch: Orchestrator = Depends(orchestrator)) -> Response:
    orch.secrets.delete(secret_owner(request), secret_id)
    return Response(status_code=204)

"""``POST /sandboxes-compose``: a Docker Compose project in one sandbox (``core/compose.py``). The answer is
E2B's sandbox JSON (``Sandbox.connect(id)`` of the unmodified SDK works on it) plus ``compose``: the project
and each service's state and published ports, with the host the sandbox proxy serves each port under."""

from __future__ import annotations

import base64
import binascii

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from aenv.api import serialize
from aenv.api.auth import require_api_key
from aenv.api.deps import orchestrator
from aenv.api.models import NewComposeSandbox
from aenv.api.routes_sandboxes import create_request
from aenv.core.compose import ComposeRequest
from aenv.core.orchestrator import Orchestrator
from aenv.errors import InvalidRequest

router = APIRouter(dependencies=[Depends(require_api_key)])


def _contexts(raw: dict[str, str], limit: int) -> dict[str, bytes]:
    if sum(len(v) for v in raw.values()) * 3 // 4 > limit + 3 * len(raw):
        raise InvalidRequest(f"buildContexts: more than {limit} bytes")
    out = {}
    for name, text in raw.items():
        try:
            out[name] = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequest(f"buildContexts.{name}: not base64") from None
    return out


@router.post("/sandboxes-compose", status_code=201)
async def create_compose(request: Request, body: NewComposeSandbox,
                         orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:
    env = body.composeEnv or {}
    if sum(len(k) + len(v) for k, v in env.items()) > orch.settings.max_metadata_bytes * 4:
        raise InvalidRequest(f"composeEnv: more than {orch.settings.max_metadata_bytes * 4} bytes")
    create = create_request(request, body, orch, None, secure_default=True)
    result = await orch.compose.up(ComposeRequest(
        create, body.compose, env, tuple(body.profiles or ()),
        _contexts(body.buildContexts or {}, orch.settings.compose_max_context_bytes), body.startupTimeout))
    return JSONResponse(serialize.sandbox(result.sandbox) | {"compose": serialize.compose(result)}, status_code=201)

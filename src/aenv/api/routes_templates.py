"""E2B template routes (list, get, delete, alias lookup) and aenv's pull extension."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from aenv.api import tenancy
from aenv.api.auth import principal, require_api_key
from aenv.api.deps import orchestrator
from aenv.api.errors import status_for
from aenv.api.serialize import iso
from aenv.core.orchestrator import Orchestrator
from aenv.envd import ENVD_VERSION
from aenv.errors import AenvError, InvalidRequest, TemplateNotFound
from aenv.kinds import TemplateKind
from aenv.store.sqlite import TemplateRow

router = APIRouter(dependencies=[Depends(require_api_key)])


def template_json(row: TemplateRow) -> dict[str, Any]:
    return {
        "templateID": row.id,
        "buildID": row.id,
        "aliases": [row.alias] if row.alias else [],
        "names": [row.alias] if row.alias else [],
        "public": row.public,
        "cpuCount": row.cpu_count,
        "memoryMB": row.memory_mb,
        "diskSizeMB": row.disk_mb,
        "createdAt": iso(row.created_at),
        "updatedAt": iso(row.created_at),
        "lastSpawnedAt": None,
        "spawnCount": 0,
        "buildCount": 1,
        "buildStatus": "ready",
        "envdVersion": ENVD_VERSION,
        "kind": row.kind,
        "source": row.source,
        "sizeBytes": row.size_bytes,
    }


@router.get("/v2/templates")
@router.get("/templates")
async def list_templates(request: Request, orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:
    who = principal(request)
    return JSONResponse([template_json(r) for r in orch.list_templates() if tenancy.template_visible(who, r)])


@router.get("/default-templates")
async def default_templates(orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:  # the server's own: every team's
    """E2B's default templates: here the ones this server builds itself (``base``, the code interpreter)."""
    return JSONResponse([template_json(r) for r in orch.list_templates() if r.kind == TemplateKind.BOOTSTRAP])


@router.get("/templates/aliases/{alias}")
async def get_alias(alias: str, request: Request, orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:
    try:
        row = orch.get_template(alias)
    except TemplateNotFound:  # a built name whose tags are all other than ``default``
        template_id = orch.builds.template_id_of(alias)
        tenancy.check_template_use(request, template_id)
        return JSONResponse({"templateID": template_id, "public": False})
    if not tenancy.template_visible(principal(request), row):
        raise TemplateNotFound(alias)
    return JSONResponse({"templateID": row.id, "public": row.public})


@router.get("/templates/{template_id}")
async def get_template(template_id: str, orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:
    return JSONResponse(template_json(orch.get_template(template_id)))


class TemplateUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    public: StrictBool


NOT_PUBLISHABLE = "public: the server's own templates (base, code-interpreter-v1) are every team's already"


@router.patch("/templates/{template_id}")
@router.patch("/v2/templates/{template_id}")
async def update_template(template_id: str, body: TemplateUpdate, orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:
    """E2B's publish/unpublish: a published template is every team's to start sandboxes from (only its
    team changes or deletes it; the path check in ``tenancy.py`` lets no other team this far)."""
    row = orch.get_template(template_id)
    if not row.owner:
        raise InvalidRequest(NOT_PUBLISHABLE)
    orch.ctx.store.set_template_public(row.id, body.public)
    return JSONResponse({"names": [row.alias] if row.alias else []})


@router.delete("/templates/{template_id:path}", status_code=204)
async def delete_template(template_id: str, orch: Orchestrator = Depends(orchestrator)) -> Response:
    await orch.delete_template(template_id)
    return Response(status_code=204)


class PullBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    image: str = Field(min_length=1, max_length=512)
    name: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[a-z0-9][a-z0-9._-]*$")
    startCmd: str | None = Field(default=None, max_length=4096)
    readyCmd: str | None = Field(default=None, max_length=4096)
    cpuCount: int | None = Field(default=None, ge=1, le=64)
    memoryMB: int | None = Field(default=None, ge=64, le=262144)


@router.post("/aenv/templates/pull")
async def pull_template(body: PullBody, request: Request, orch: Orchestrator = Depends(orchestrator)) -> StreamingResponse:
    """aenv extension: pull an OCI image and register it as a template, streaming NDJSON progress events.

    The pull runs to completion even if the client goes away (a half-built template is never visible)."""
    from aenv.images import parse_reference

    try:
        parse_reference(body.image)  # a bad reference is a 400 before the stream starts
    except Exception as exc:
        raise InvalidRequest(f"invalid image reference '{body.image}': {exc}") from None
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    async def run() -> None:
        try:
            row, summary = await orch.pull_template(
                body.image, progress=lambda ev: queue.put_nowait({"event": ev.to_json()}), name=body.name,
                start_cmd=body.startCmd, ready_cmd=body.readyCmd, cpu_count=body.cpuCount, memory_mb=body.memoryMB,
                owner=tenancy.owner(request),
            )  # fmt: skip
            queue.put_nowait({"template": template_json(row), "summary": summary})
        except AenvError as exc:
            queue.put_nowait({"error": {"code": status_for(exc), "message": exc.message}})
        except Exception as exc:  # never a bare 500 mid-stream: the client gets the reason
            queue.put_nowait({"error": {"code": 500, "message": f"pull failed: {type(exc).__name__}: {exc}"}})
        finally:
            queue.put_nowait(None)

    task = asyncio.create_task(run())
    request.app.state.background.add(task)
    task.add_done_callback(request.app.state.background.discard)

    async def stream() -> AsyncIterator[bytes]:
        while (item := await queue.get()) is not None:
            yield (json.dumps(item) + "\n").encode()

    return StreamingResponse(stream(), media_type="application/x-ndjson")


# The image cache is the server's, shared by every team: its routes are the operators'.
@router.get("/aenv/cache", dependencies=[Depends(tenancy.require_admin)])
async def cache_ls(orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:
    return JSONResponse(orch.cache_listing())


@router.post("/aenv/cache/pin/{template}", dependencies=[Depends(tenancy.require_admin)])
async def cache_pin(template: str, orch: Orchestrator = Depends(orchestrator), unpin: bool = False) -> JSONResponse:
    return JSONResponse(await orch.pin_cache(template, pinned=not unpin))


@router.post("/aenv/cache/prune", dependencies=[Depends(tenancy.require_admin)])
async def cache_prune(orch: Orchestrator = Depends(orchestrator), all: bool = False) -> JSONResponse:
    return JSONResponse(await orch.prune_cache(everything_unpinned=all))

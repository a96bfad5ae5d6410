"""E2B template routes (list, get, delete, alias lookup) and aenv's pull extension."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from aenv.api.auth import require_api_key
from aenv.api.deps import orchestrator
from aenv.api.errors import status_for
from aenv.api.serialize import iso
from aenv.core.orchestrator import Orchestrator
from aenv.core.templates import TemplateCatalog, sandbox_image_of
from aenv.envd import ENVD_VERSION
from aenv.errors import AenvError, InvalidRequest
from aenv.store.sqlite import TemplateRow

router = APIRouter(dependencies=[Depends(require_api_key)])


async def catalog(request: Request) -> TemplateCatalog:  # async: no thread-pool hop
    cat: TemplateCatalog = request.app.state.catalog
    return cat


def template_json(row: TemplateRow) -> dict[str, Any]:
    return {
        "templateID": row.id,
        "buildID": row.id,
        "aliases": [row.alias] if row.alias else [],
        "names": [row.alias] if row.alias else [],
        "public": False,
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
async def list_templates(cat: TemplateCatalog = Depends(catalog)) -> JSONResponse:
    return JSONResponse([template_json(r) for r in cat.list_templates()])


@router.get("/templates/aliases/{alias}")
async def get_alias(alias: str, cat: TemplateCatalog = Depends(catalog)) -> JSONResponse:
    row = cat.resolve(alias)
    return JSONResponse({"templateID": row.id, "public": False})


@router.get("/templates/{template_id}")
async def get_template(template_id: str, cat: TemplateCatalog = Depends(catalog)) -> JSONResponse:
    return JSONResponse(template_json(cat.resolve(template_id)))


@router.delete("/templates/{template_id:path}", status_code=204)
async def delete_template(
    template_id: str,
    request: Request,
    cat: TemplateCatalog = Depends(catalog),
    orch: Orchestrator = Depends(orchestrator),
) -> Response:
    row = cat.resolve(template_id)
    if row.kind == "snapshot":
        await orch.snapshots.delete(row.id)
        return Response(status_code=204)
    cat.delete(template_id, in_use=orch.template_ids_in_use())
    digest = row.config.get("manifest_digest")
    if digest and not any(t.config.get("manifest_digest") == digest for t in cat.list_templates()):
        # The last template of this image is gone: its layers may now be evicted.
        request.app.state.image_builder.release_image(digest)
    return Response(status_code=204)


class PullBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    image: str = Field(min_length=1, max_length=512)
    name: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[a-z0-9][a-z0-9._-]*$")
    startCmd: str | None = Field(default=None, max_length=4096)
    readyCmd: str | None = Field(default=None, max_length=4096)
    cpuCount: int | None = Field(default=None, ge=1, le=64)
    memoryMB: int | None = Field(default=None, ge=64, le=262144)


def default_name(reference: str) -> str:
    """`docker.io/library/ubuntu:22.04@sha256:…` → `ubuntu-22.04` (a valid template alias)."""
    from aenv.images.reference import parse_reference

    ref = parse_reference(reference)
    repo = ref.repository.rsplit("/", 1)[-1]
    tag = ref.tag or "latest"
    return re.sub(r"[^a-z0-9._-]", "-", f"{repo}-{tag}".lower()) if tag != "latest" else repo.lower()


@router.post("/aenv/templates/pull")
async def pull_template(body: PullBody, request: Request, orch: Orchestrator = Depends(orchestrator)) -> StreamingResponse:
    """aenv extension: pull an OCI image and register it as a template, streaming NDJSON progress events.

    The pull runs to completion even if the client goes away (a half-built template is never visible)."""
    from aenv.images.reference import parse_reference

    try:
        parse_reference(body.image)
    except Exception as exc:
        raise InvalidRequest(f"invalid image reference '{body.image}': {exc}") from None
    builder = request.app.state.image_builder
    cat: TemplateCatalog = request.app.state.catalog
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    async def run() -> None:
        try:
            tpl = await builder.pull(body.image, progress=lambda ev: queue.put_nowait({"event": ev.to_json()}))
            image = sandbox_image_of(tpl, "", start_cmd=body.startCmd, ready_cmd=body.readyCmd)
            name = body.name or default_name(body.image)
            row = cat.register(
                alias=name,
                kind="image",
                rootfs=image.rootfs,
                lowers=list(image.lowers),
                config={
                    "env": image.env, "workdir": image.workdir, "user": image.user,
                    "start_cmd": image.start_cmd, "ready_cmd": image.ready_cmd,
                    "manifest_digest": tpl.manifest_digest, "image_user": tpl.config.user,
                },
                source=tpl.reference,
                cpu_count=body.cpuCount,
                memory_mb=body.memoryMB,
                size_bytes=tpl.size,
                pinned_layers=list(tpl.layer_digests),
            )
            queue.put_nowait({"template": template_json(row), "summary": tpl.summary()})
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


@router.get("/aenv/cache")
async def cache_ls(request: Request) -> JSONResponse:
    cache = request.app.state.image_builder.cache
    return JSONResponse({"usage": asdict(cache.usage()), "entries": [asdict(e) for e in cache.entries()]})


@router.post("/aenv/cache/prune")
async def cache_prune(request: Request, all: bool = False) -> JSONResponse:
    cache = request.app.state.image_builder.cache
    removed = await asyncio.to_thread(cache.prune, everything_unpinned=all)
    return JSONResponse({"removed": [asdict(e) for e in removed], "freed": sum(e.size for e in removed)})

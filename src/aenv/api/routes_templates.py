"""E2B template routes (list, get, delete, alias lookup) and aenv's pull extension."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from aenv.api.auth import require_api_key
from aenv.api.deps import orchestrator
from aenv.api.serialize import iso
from aenv.core.orchestrator import Orchestrator
from aenv.core.templates import TemplateCatalog
from aenv.envd import ENVD_VERSION
from aenv.store.sqlite import TemplateRow

router = APIRouter(dependencies=[Depends(require_api_key)])


def catalog(request: Request) -> TemplateCatalog:
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
    return JSONResponse([template_json(r) for r in cat.list()])


@router.get("/templates/aliases/{alias}")
async def get_alias(alias: str, cat: TemplateCatalog = Depends(catalog)) -> JSONResponse:
    row = cat.resolve(alias)
    return JSONResponse({"templateID": row.id, "public": False})


@router.get("/templates/{template_id}")
async def get_template(template_id: str, cat: TemplateCatalog = Depends(catalog)) -> JSONResponse:
    return JSONResponse(template_json(cat.resolve(template_id)))


@router.delete("/templates/{template_id:path}", status_code=204)
async def delete_template(
    template_id: str, cat: TemplateCatalog = Depends(catalog), orch: Orchestrator = Depends(orchestrator)
) -> Response:
    row = cat.resolve(template_id)
    if row.kind == "snapshot":
        await orch.snapshots.delete(row.id)
    else:
        cat.delete(template_id, in_use=orch.template_ids_in_use())
    return Response(status_code=204)

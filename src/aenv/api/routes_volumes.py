"""E2B volumes: the control plane (``/volumes``, API key) and the volume content API
(``/volumecontent/{id}/…``, ``Authorization: Bearer <volume token>``), thin over ``core/volumes.py``.

The SDK sends the content API to ``E2B_VOLUME_API_URL`` (else ``api.<domain>``): point it at this
server. Query parameters aenv does not know are a 400 naming them, as unknown body fields are.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

from fastapi import APIRouter, Body, Depends, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from aenv.api import serialize, tenancy
from aenv.api.auth import require_api_key
from aenv.api.deps import orchestrator
from aenv.api.models import NewVolume, VolumeMetadata
from aenv.core.orchestrator import Orchestrator
from aenv.errors import InvalidRequest
from aenv.runtime.volume_files import CHUNK, Owner, VolumeDir

router = APIRouter()
control = APIRouter(dependencies=[Depends(require_api_key)])

WRITE_PARAMS = frozenset({"path", "uid", "gid", "mode", "force"})
UPLOAD_BUFFER = 1 << 20


def _owner(request: Request) -> str | None:
    """Whose objects a request reads or acts on: its team's (None: every team's, for an admin)."""
    return tenancy.list_owner(request)


# ---- control plane ------------------------------------------------------------------------------
@control.post("/volumes", status_code=201)
async def create_volume(request: Request, body: NewVolume, orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:
    body.refuse_unsupported()
    await orch.check_disk(tenancy.owner(request))
    row = await orch.volumes.create(tenancy.owner(request), body.name)
    return JSONResponse(serialize.volume(row), status_code=201)


@control.get("/volumes")
async def list_volumes(request: Request, orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:
    return JSONResponse([serialize.volume(r, token=False) for r in orch.volumes.of_owner(_owner(request))])


@control.get("/volumes/{volume_id}")
async def get_volume(request: Request, volume_id: str, orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:
    return JSONResponse(serialize.volume(orch.volumes.get(_owner(request), volume_id)))


@control.delete("/volumes/{volume_id}", status_code=204)
async def delete_volume(request: Request, volume_id: str, orch: Orchestrator = Depends(orchestrator)) -> Response:
    await orch.volumes.destroy(_owner(request), volume_id)
    return Response(status_code=204)


# ---- content API --------------------------------------------------------------------------------
def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None


async def _volume(request: Request, volume_id: str) -> VolumeDir:
    orch: Orchestrator = request.app.state.orchestrator
    return orch.volumes.content(volume_id, _bearer(request))


def _params(request: Request, allowed: frozenset[str]) -> dict[str, str]:
    q = request.query_params
    unknown = sorted(set(q.keys()) - allowed)
    if unknown:
        raise InvalidRequest(f"{', '.join(unknown)}: not supported by aenv (unknown query parameter)")
    if not q.get("path"):
        raise InvalidRequest("path: required")
    return dict(q)


def _int(params: dict[str, str], name: str, maximum: int) -> int | None:
    raw = params.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw, 10)
    except ValueError:
        raise InvalidRequest(f"{name}: '{raw}' is not an integer") from None
    if not 0 <= value <= maximum:
        raise InvalidRequest(f"{name}: {value} is out of range (0-{maximum})")
    return value


def _bool(params: dict[str, str], name: str) -> bool:
    raw = params.get(name, "false").lower()
    if raw not in ("true", "false", "1", "0"):
        raise InvalidRequest(f"{name}: '{raw}' is not a boolean")
    return raw in ("true", "1")


def _owner_params(params: dict[str, str]) -> Owner:
    return Owner(_int(params, "uid", 2**32 - 2), _int(params, "gid", 2**32 - 2), _int(params, "mode", 0o7777))


@router.get("/volumecontent/{volume_id}/path")
async def stat_path(request: Request, volume_id: str) -> JSONResponse:
    params = _params(request, frozenset({"path"}))
    vol = await _volume(request, volume_id)
    return JSONResponse(await asyncio.to_thread(vol.stat, params["path"]))


@router.patch("/volumecontent/{volume_id}/path")
async def update_path(request: Request, volume_id: str, body: VolumeMetadata = Body(default_factory=VolumeMetadata)) -> JSONResponse:
    body.refuse_unsupported()
    params = _params(request, frozenset({"path"}))
    vol = await _volume(request, volume_id)
    return JSONResponse(await asyncio.to_thread(vol.update, params["path"], Owner(body.uid, body.gid, body.mode)))


@router.delete("/volumecontent/{volume_id}/path", status_code=204)
async def remove_path(request: Request, volume_id: str) -> Response:
    params = _params(request, frozenset({"path"}))
    vol = await _volume(request, volume_id)
    await asyncio.to_thread(vol.remove, params["path"])
    return Response(status_code=204)


@router.get("/volumecontent/{volume_id}/dir")
async def list_dir(request: Request, volume_id: str) -> JSONResponse:
    params = _params(request, frozenset({"path", "depth"}))
    depth = _int(params, "depth", 1 << 16)
    vol = await _volume(request, volume_id)
    return JSONResponse(await asyncio.to_thread(vol.listdir, params["path"], depth if depth is not None else 1))


@router.post("/volumecontent/{volume_id}/dir", status_code=201)
async def make_dir(request: Request, volume_id: str) -> JSONResponse:
    params = _params(request, WRITE_PARAMS)
    owner, force = _owner_params(params), _bool(params, "force")
    vol = await _volume(request, volume_id)
    return JSONResponse(await asyncio.to_thread(vol.make_dir, params["path"], owner, force), status_code=201)


@router.get("/volumecontent/{volume_id}/file")
async def read_file(request: Request, volume_id: str) -> StreamingResponse:
    params = _params(request, frozenset({"path"}))
    vol = await _volume(request, volume_id)
    fd = await asyncio.to_thread(vol.open_read, params["path"])
    size = os.fstat(fd).st_size

    def chunks() -> Iterator[bytes]:  # Starlette iterates it in its thread pool; closed when done or cut
        try:
            while data := os.read(fd, CHUNK):
                yield data
        finally:
            os.close(fd)

    return StreamingResponse(chunks(), media_type="application/octet-stream", headers={"Content-Length": str(size)})


@router.put("/volumecontent/{volume_id}/file", status_code=201)
async def write_file(request: Request, volume_id: str) -> JSONResponse:
    params = _params(request, WRITE_PARAMS)
    owner, force = _owner_params(params), _bool(params, "force")
    vol = await _volume(request, volume_id)
    pending = await asyncio.to_thread(vol.begin_write, params["path"], force)
    try:
        buf = bytearray()
        async for chunk in request.stream():
            buf += chunk
            if len(buf) >= UPLOAD_BUFFER:
                await asyncio.to_thread(pending.write, bytes(buf))
                buf.clear()
        if buf:
            await asyncio.to_thread(pending.write, bytes(buf))
        entry = await asyncio.to_thread(pending.commit, owner)
    except BaseException:
        await asyncio.shield(asyncio.to_thread(pending.abort))
        raise
    return JSONResponse(entry, status_code=201)

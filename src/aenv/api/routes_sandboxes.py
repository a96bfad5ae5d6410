"""E2B control-plane routes for sandboxes (spec §2.2.1–2.2.8): thin translation to Orchestrator calls."""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal
from urllib.parse import unquote_plus

from fastapi import APIRouter, Body, Depends, Header, Query, Request, Response
from fastapi.responses import JSONResponse

from aenv.api import serialize, tenancy
from aenv.api.auth import principal, require_api_key
from aenv.api.deps import orchestrator
from aenv.api.models import ConnectBody, NetworkUpdate, NewSandbox, PauseBody, ResumeBody, TimeoutBody
from aenv.core import sandbox_logs
from aenv.core.models import CreateRequest, ListQuery, SandboxState
from aenv.core.orchestrator import Orchestrator
from aenv.core.volumes import parse_mounts
from aenv.errors import InvalidRequest, NotFound

router = APIRouter(dependencies=[Depends(require_api_key)])

MAX_LIST_LIMIT = 100
MAX_BATCH_IDS = 100  # sandboxes in one GET /sandboxes/metrics
MAX_LOG_LIMIT = 1000


def parse_metadata_filter(raw: str | None) -> dict[str, str]:
    """Decode the SDKs' double-encoded ``metadata`` query value (spec §2.2.3)."""
    if not raw:
        return {}
    out: dict[str, str] = {}
    for pair in unquote_plus(raw).split("&"):
        if not pair:
            continue
        parts = pair.split("=")
        if len(parts) != 2:
            raise InvalidRequest(f"invalid metadata filter: '{pair}' is not key=value")
        out[unquote_plus(parts[0])] = unquote_plus(parts[1])
    return out


def parse_states(raw: str | None) -> frozenset[SandboxState]:
    if not raw:
        return frozenset({SandboxState.RUNNING, SandboxState.PAUSED})
    states = set()
    for item in raw.split(","):
        item = item.strip()
        if item not in ("running", "paused"):
            raise InvalidRequest(f"invalid state '{item}': use running and/or paused")
        states.add(SandboxState(item))
    return frozenset(states)


def _parse_time(raw: str | None, name: str) -> float | None:
    if raw is None or raw == "":
        return None
    try:
        return float(raw)
    except ValueError:
        pass
    try:
        return dt.datetime.fromisoformat(raw.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise InvalidRequest(f"invalid {name}: '{raw}' is neither unix seconds nor ISO 8601") from None


def _check_metadata_size(meta: dict[str, str], limit: int) -> None:
    size = sum(len(k.encode()) + len(v.encode()) for k, v in meta.items())
    if size > limit:
        raise InvalidRequest(f"metadata too large: {size} bytes, the limit is {limit}")


def create_request(request: Request, body: NewSandbox, orch: Orchestrator, idempotency_key: str | None,
                   secure_default: bool) -> CreateRequest:
    """A create's body checked (unsupported fields, sizes, the team's template and lease) and made core's
    request: for ``POST /sandboxes`` and for compose sandboxes (``routes_compose.py``)."""
    body.refuse_unsupported()
    owner = tenancy.owner(request)
    tenancy.check_template_use(request, body.templateID)  # another team's private template: unknown
    meta = body.metadata or {}
    _check_metadata_size(meta, orch.settings.max_metadata_bytes)
    request.app.state.leases.check_binding(meta, owner)  # aenv.lease=<id>: this key's live lease
    env_vars = body.envVars or {}
    _check_metadata_size(env_vars, orch.settings.max_metadata_bytes * 4)
    if idempotency_key is not None and not (0 < len(idempotency_key) <= 255):
        raise InvalidRequest("Idempotency-Key must be 1-255 characters")
    return CreateRequest(
        template=body.templateID,
        timeout=body.timeout,
        metadata=meta,
        env_vars=env_vars,
        auto_pause=body.autoPause,
        auto_pause_memory=body.autoPauseMemory is not False,
        auto_resume=bool(body.autoResume and body.autoResume.enabled),
        allow_internet=body.allow_internet_access is not False,
        secure=body.secure if body.secure is not None else secure_default,
        cpu_count=body.cpuCount,
        memory_mb=body.memoryMB,
        idempotency_key=idempotency_key,
        network=body.network.request() if body.network is not None else None,
        owner=owner,
        admin=principal(request).admin,
        volume_mounts=tuple(parse_mounts([(m.name, m.path, m.readOnly) for m in body.volumeMounts or ()])),
        bandwidth=body.bandwidth.request() if body.bandwidth is not None else None,
    )


async def _create(request: Request, body: NewSandbox, orch: Orchestrator, idempotency_key: str | None,
                  secure_default: bool) -> JSONResponse:
    sbx = await orch.create(create_request(request, body, orch, idempotency_key, secure_default))
    return JSONResponse(serialize.sandbox(sbx), status_code=201)


@router.post("/v2/sandboxes", status_code=201)
async def create_v2(
    request: Request,
    body: NewSandbox,
    orch: Orchestrator = Depends(orchestrator),
    idempotency_key: str | None = Header(default=None, alias="Idempotency-Key"),
) -> JSONResponse:
    # New SDKs do not send `secure`; E2B issues an access token by default, and so do we.
    return await _create(request, body, orch, idempotency_key, secure_default=True)


@router.post("/sandboxes", status_code=201)
async def create_legacy(request: Request, body: NewSandbox, orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:
    return await _create(request, body, orch, None, secure_default=False)


@router.get("/v2/sandboxes")
async def list_v2(
    request: Request,
    orch: Orchestrator = Depends(orchestrator),
    metadata: str | None = None,
    state: str | None = None,
    limit: int = Query(MAX_LIST_LIMIT, ge=1, le=MAX_LIST_LIMIT),
    nextToken: str | None = None,
    order: str = Query("desc", pattern="^(asc|desc)$"),
    startedAfter: str | None = None,
    template: str | None = None,
) -> JSONResponse:
    query = ListQuery(
        states=parse_states(state),
        metadata=parse_metadata_filter(metadata),
        template=template,
        started_after=_parse_time(startedAfter, "startedAfter"),
        descending=order == "desc",
        limit=limit,
        after=nextToken,
        owner=tenancy.list_owner(request),
    )
    page, token = orch.list_sandboxes(query)
    headers = {"X-Next-Token": token} if token else None
    return JSONResponse([serialize.listed(s) for s in page], headers=headers)


@router.get("/sandboxes")
async def list_legacy(request: Request, orch: Orchestrator = Depends(orchestrator), metadata: str | None = None) -> JSONResponse:
    query = ListQuery(
        states=frozenset({SandboxState.RUNNING}), metadata=parse_metadata_filter(metadata), limit=10**9,
        owner=tenancy.list_owner(request),
    )
    page, _ = orch.list_sandboxes(query)
    return JSONResponse([serialize.listed(s) for s in page])


@router.get("/sandboxes/metrics")  # before /sandboxes/{sandbox_id}, which would take "metrics" for an ID
async def batch_metrics(
    request: Request, orch: Orchestrator = Depends(orchestrator), sandbox_ids: str = Query("", max_length=MAX_BATCH_IDS * 64)
) -> JSONResponse:
    """E2B's ``GET /sandboxes/metrics?sandbox_ids=a,b``: each sandbox's latest sample. An ID that names
    no running or paused sandbox is left out, as E2B does."""
    ids = [i for i in dict.fromkeys(x.strip() for x in sandbox_ids.split(",")) if i]
    if not ids:
        raise InvalidRequest("sandbox_ids: name at least one sandbox (comma-separated)")
    if len(ids) > MAX_BATCH_IDS:
        raise InvalidRequest(f"sandbox_ids: at most {MAX_BATCH_IDS} sandboxes, got {len(ids)}")
    out: dict[str, Any] = {}
    who = principal(request)
    for sid in ids:
        try:
            if not who.sees(orch.get(sid).row.owner):
                continue  # another team's: left out, as an unknown ID is
            samples = await orch.metrics(sid, None, None)
        except NotFound:
            continue
        if samples:
            out[sid] = serialize.metric(samples[-1])
    return JSONResponse({"sandboxes": out})


@router.get("/sandboxes/{sandbox_id}/logs")
async def logs_v1(sandbox_id: str, request: Request, orch: Orchestrator = Depends(orchestrator),
                  start: int | None = Query(None, ge=0), limit: int = Query(1000, ge=1, le=MAX_LOG_LIMIT)) -> JSONResponse:
    """E2B's sandbox logs (``start``: milliseconds since the epoch): what the server did with the
    sandbox and why (``core/sandbox_logs.py``), also after it ended."""
    events = await _logs(request, orch, sandbox_id, limit=limit, cursor=None if start is None else start / 1000)
    return JSONResponse(sandbox_logs.v1_body(events))


@router.get("/v2/sandboxes/{sandbox_id}/logs")
async def logs_v2(sandbox_id: str, request: Request, orch: Orchestrator = Depends(orchestrator),
                  cursor: int | None = Query(None, ge=0), limit: int = Query(1000, ge=1, le=MAX_LOG_LIMIT),
                  direction: Literal["forward", "backward"] = "forward",
                  level: Literal["debug", "info", "warn", "error"] = "debug",
                  search: str | None = Query(None, max_length=256)) -> JSONResponse:
    events = await _logs(request, orch, sandbox_id, limit=limit, forward=direction == "forward",
                         cursor=None if cursor is None else cursor / 1000, min_level=level, search=search)
    return JSONResponse({"logs": [sandbox_logs.entry(e) for e in events]})


async def _logs(request: Request, orch: Orchestrator, sandbox_id: str, **query: Any) -> list[Any]:
    try:
        orch.get(sandbox_id)
    except NotFound:
        if orch.gone.find(sandbox_id) is None:  # never heard of: as unknown as any other unknown ID
            raise
    logs: sandbox_logs.SandboxLogs = request.app.state.sandbox_logs
    return await logs.page(sandbox_id, **query)


@router.get("/sandboxes/{sandbox_id}")
async def get_sandbox(sandbox_id: str, orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:
    return JSONResponse(serialize.detail(orch.get(sandbox_id)))


@router.get("/unstable/sandboxes/{sandbox_id}/record")
async def sandbox_record(sandbox_id: str, orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:
    """E2B's record of the sandbox's latest run. aenv holds one for a sandbox it still has (running or
    paused: a run not ended, its data retained); of an ended one it keeps why it ended and its log
    lines, not a record, so its ID answers the 404 ``GET /sandboxes/{id}`` gives (when and why)."""
    return JSONResponse(serialize.record(orch.get(sandbox_id)))


@router.delete("/sandboxes/{sandbox_id}", status_code=204)
async def kill_sandbox(sandbox_id: str, orch: Orchestrator = Depends(orchestrator)) -> Response:
    await orch.kill(sandbox_id)
    return Response(status_code=204)


@router.put("/sandboxes/{sandbox_id}/network", status_code=204)
async def update_network(request: Request, sandbox_id: str, body: NetworkUpdate,
                         orch: Orchestrator = Depends(orchestrator)) -> Response:
    """E2B's live network update (``sbx.update_network``): the body replaces the egress rules."""
    body.refuse_unsupported()
    await orch.update_network(sandbox_id, body.request(), body.allow_internet_access)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/timeout", status_code=204)
async def set_timeout(sandbox_id: str, body: TimeoutBody, orch: Orchestrator = Depends(orchestrator)) -> Response:
    body.refuse_unsupported()
    await orch.set_timeout(sandbox_id, body.timeout)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/refreshes", status_code=204)
async def refresh(
    sandbox_id: str, body: dict[str, Any] | None = Body(default=None), orch: Orchestrator = Depends(orchestrator)
) -> Response:
    duration = (body or {}).get("duration")
    if duration is not None and (not isinstance(duration, int) or isinstance(duration, bool)):
        raise InvalidRequest("duration must be an integer number of seconds")
    await orch.connect(sandbox_id, duration)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/pause", status_code=204)
async def pause(
    sandbox_id: str, body: PauseBody | None = None, orch: Orchestrator = Depends(orchestrator)
) -> Response:
    body = body or PauseBody()
    body.refuse_unsupported()
    await orch.pause(sandbox_id, keep_memory=body.memory is not False, require_healthy_guest=bool(body.requireHealthyGuest))
    return Response(status_code=204)


async def _connect(sandbox_id: str, body: ConnectBody | None, orch: Orchestrator) -> JSONResponse:
    body = body or ConnectBody()
    body.refuse_unsupported()
    auto_pause = body.autoPause if isinstance(body, ResumeBody) else None
    sbx, resumed = await orch.connect(sandbox_id, body.timeout, keep_memory=body.memory is not False,
                                      auto_pause=auto_pause)
    return JSONResponse(serialize.sandbox(sbx), status_code=201 if resumed else 200)


@router.post("/v2/sandboxes/{sandbox_id}/connect")
async def connect_v2(
    sandbox_id: str, body: ConnectBody | None = None, orch: Orchestrator = Depends(orchestrator)
) -> JSONResponse:
    return await _connect(sandbox_id, body, orch)


@router.post("/sandboxes/{sandbox_id}/connect")
async def connect_legacy(
    sandbox_id: str, body: ConnectBody | None = None, orch: Orchestrator = Depends(orchestrator)
) -> JSONResponse:
    return await _connect(sandbox_id, body, orch)


@router.post("/sandboxes/{sandbox_id}/resume", status_code=201)
async def resume_legacy(
    sandbox_id: str, body: ResumeBody | None = None, orch: Orchestrator = Depends(orchestrator)
) -> JSONResponse:
    sbx = orch.get(sandbox_id)
    if sbx.state is SandboxState.RUNNING:
        return JSONResponse({"code": 409, "message": f"sandbox '{sandbox_id}' is already running"}, status_code=409)
    return await _connect(sandbox_id, body or ResumeBody(), orch)


@router.get("/sandboxes/{sandbox_id}/metrics")
async def metrics(
    sandbox_id: str, orch: Orchestrator = Depends(orchestrator), start: str | None = None, end: str | None = None
) -> JSONResponse:
    samples = await orch.metrics(sandbox_id, _parse_time(start, "start"), _parse_time(end, "end"))
    return JSONResponse([serialize.metric(s) for s in samples])

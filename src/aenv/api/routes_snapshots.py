"""Snapshots, fork (E2B spec §2.2.9–2.2.10) and aenv's rollback extension."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse
from pydantic import Field, StrictBool, StrictInt

from aenv.api import serialize, tenancy
from aenv.api.auth import principal, require_api_key
from aenv.api.deps import orchestrator
from aenv.api.errors import status_for
from aenv.api.models import _Body
from aenv.api.serialize import iso
from aenv.core.orchestrator import Orchestrator
from aenv.errors import AenvError
from aenv.machine_key import parse as machine_record
from aenv.store.sqlite import SnapshotRow
from aenv.teams import Principal

router = APIRouter(dependencies=[Depends(require_api_key)])


class SnapshotBody(_Body):
    name: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
    memory: StrictBool | None = None
    mode: str | None = Field(default=None, pattern="^(full|filesystem)$")


class ForkBody(_Body):
    timeout: StrictInt | None = None
    count: StrictInt | None = Field(default=None, ge=1)


class RollbackBody(_Body):
    snapshotID: str = Field(min_length=1, max_length=256)


def snapshot_json(row: SnapshotRow, orch: Orchestrator, detail: bool = False,
                  who: Principal | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "snapshotID": row.id,
        "names": [row.name] if row.name else [],
        "mode": row.mode,
        "sandboxID": row.sandbox_id,
        "parentID": row.parent_id,
        "templateID": row.template_id,
        "createdAt": iso(row.created_at),
        "sizeBytes": row.size_bytes,
    }
    result = orch.snapshot_result(row)
    if result.paused_ms is not None:
        out["pausedMs"] = result.paused_ms  # aenv: how long the sandbox was stopped to take it
    if (machine := machine_record(result.data.get("machine"))) is not None:
        out["machine"] = machine  # aenv (vm): where it restores; a gateway places its creates by it
    if "incremental" in result.data:
        out["incremental"] = result.data["incremental"]  # aenv: what it shares with the previous full snapshot
    # aenv: the runtime is still writing its files (usable already; sizeBytes is final once false)
    out["writing"] = orch.snapshot_writing(row.id)
    if detail:
        tree = orch.snapshot_tree(row.id)
        if who is not None and not who.admin:  # a tree may reach into another team's (a public snapshot's child)
            tree = {k: [i for i in ids if _sees(orch, who, i)] for k, ids in tree.items()}
        out.update(tree)
        out["published"] = row.published
    return out


@router.post("/sandboxes/{sandbox_id}/snapshots", status_code=201)
async def create_snapshot(
    sandbox_id: str, body: SnapshotBody | None = None, orch: Orchestrator = Depends(orchestrator)
) -> JSONResponse:
    body = body or SnapshotBody()
    mode = body.mode or ("filesystem" if body.memory is False else "full")
    row = await orch.snapshot(sandbox_id, body.name, mode)
    return JSONResponse(snapshot_json(row, orch), status_code=201)


@router.get("/snapshots")
async def list_snapshots(
    request: Request,
    orch: Orchestrator = Depends(orchestrator),
    sandboxID: str | None = None,
    name: str | None = None,
    limit: int = Query(100, ge=1, le=1000),
    nextToken: str | None = None,
) -> JSONResponse:
    team = tenancy.list_owner(request)
    rows = [r for r in orch.list_snapshots(sandbox_id=sandboxID, name=name) if team is None or r.owner == team]
    rows.sort(key=lambda r: (r.created_at, r.id), reverse=True)
    if nextToken:
        ids = [r.id for r in rows]
        rows = rows[ids.index(nextToken) + 1 :] if nextToken in ids else []
    page = rows[:limit]
    headers = {"X-Next-Token": page[-1].id} if len(rows) > limit and page else None
    return JSONResponse([snapshot_json(r, orch) for r in page], headers=headers)


@router.get("/snapshots/{snapshot_id}")
async def get_snapshot(snapshot_id: str, request: Request, orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:
    return JSONResponse(snapshot_json(orch.get_snapshot(snapshot_id), orch, detail=True, who=principal(request)))


def _sees(orch: Orchestrator, who: Principal, object_id: str) -> bool:
    """A snapshot or sandbox ID of the tree that ``who`` may know of."""
    snap = orch.find_snapshot(object_id)
    if snap is not None:
        return who.sees(snap.owner)
    try:
        return who.sees(orch.get(object_id).row.owner)
    except AenvError:
        return False


@router.post("/sandboxes/{sandbox_id}/fork", status_code=201)
async def fork(sandbox_id: str, body: ForkBody | None = None, orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:
    body = body or ForkBody()
    results = await orch.fork(sandbox_id, body.count or 1, body.timeout)
    out: list[dict[str, Any]] = []
    # What the runtime really copied ("full" or "filesystem"): the fork point is the children's
    # lineage head; clients that care read ``mode`` (or the header) rather than assume memory came along.
    fork_mode: str | None = None
    for r in results:
        if isinstance(r, AenvError):
            out.append({"error": {"code": status_for(r), "message": r.message}})
        else:
            point = orch.find_snapshot(r.row.lineage_head) if r.row.lineage_head else None
            fork_mode = point.mode if point is not None else None
            out.append({"sandbox": serialize.sandbox(r), "mode": fork_mode, "snapshotID": r.row.lineage_head})
    headers = {"X-Aenv-Fork-Mode": fork_mode} if fork_mode else None
    return JSONResponse(out, status_code=201, headers=headers)


@router.post("/sandboxes/{sandbox_id}/rollback")
async def rollback(sandbox_id: str, body: RollbackBody, request: Request,
                   orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:
    tenancy.check_snapshot(request, body.snapshotID)
    sbx = await orch.rollback(sandbox_id, body.snapshotID)
    return JSONResponse(serialize.sandbox(sbx))


"""aenv's heartbeat leases (``core/leases.py``), under ``/aenv/leases``:

- ``POST /aenv/leases`` ``{"ttl": 30, "name": "run7"}`` → 201 with the lease (``leaseID``);
- ``POST /aenv/leases/{id}/heartbeat`` → the lease, its expiry pushed to now + ttl; 410 once it ended;
- ``DELETE /aenv/leases/{id}`` → ends it now and kills its sandboxes (which, and which could not be);
- ``GET /aenv/leases`` and ``GET /aenv/leases/{id}`` → the team's leases, with how many sandboxes each holds.

A sandbox joins a lease with the metadata pair ``aenv.lease=<id>`` at create (its forks inherit it).
A lease belongs to the team of the key that made it; another team sees a 404 (an admin key sees all).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from aenv.api import tenancy
from aenv.api.auth import require_api_key
from aenv.api.deps import orchestrator
from aenv.core.fleet import matching
from aenv.core.leases import LEASE_KEY, Leases, public
from aenv.core.orchestrator import Orchestrator
from aenv.store.leases import LeaseRow

router = APIRouter(dependencies=[Depends(require_api_key)])
LEASE_ID_HEADER = "X-Aenv-Lease-Id"


class NewLease(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ttl: float = Field(description="seconds without a heartbeat after which the lease ends")
    name: str = Field("", max_length=200)


def leases_of(request: Request) -> Leases:
    leases: Leases = request.app.state.leases
    return leases


def _owner(request: Request) -> str | None:
    """Whose objects a request reads or acts on: its team's (None: every team's, for an admin)."""
    return tenancy.list_owner(request)


def _answer(row: LeaseRow, orch: Orchestrator, status: int = 200) -> JSONResponse:
    bound = len(matching(orch.table, {LEASE_KEY: row.id})) if row.live else 0
    return JSONResponse(public(row, bound), status_code=status)


@router.post("/aenv/leases", status_code=201)
async def create_lease(request: Request, body: NewLease, orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:
    lease_id = request.headers.get(LEASE_ID_HEADER)  # a gateway's: the same lease on every node
    return _answer(leases_of(request).create(tenancy.owner(request), body.ttl, body.name, lease_id), orch, 201)


@router.get("/aenv/leases")
async def list_leases(request: Request, orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:
    rows = leases_of(request).listing(_owner(request))
    return JSONResponse([public(r, len(matching(orch.table, {LEASE_KEY: r.id})) if r.live else 0) for r in rows])


@router.get("/aenv/leases/{lease_id}")
async def get_lease(lease_id: str, request: Request, orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:
    return _answer(leases_of(request).get(lease_id, _owner(request)), orch)


@router.post("/aenv/leases/{lease_id}/heartbeat")
async def heartbeat(lease_id: str, request: Request, orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:
    return _answer(leases_of(request).heartbeat(lease_id, _owner(request)), orch)


@router.delete("/aenv/leases/{lease_id}")
async def end_lease(lease_id: str, request: Request) -> JSONResponse:
    row, report = await leases_of(request).end(lease_id, _owner(request))
    return JSONResponse({**public(row, 0), "killed": report.killed,
                         "failed": [{"sandboxID": sid, "message": why} for sid, why in report.failed]})  # fmt: skip

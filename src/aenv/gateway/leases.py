"""Heartbeat leases through the gateway: one lease for the whole cluster, made as the same lease (same ID,
owner, ttl) on every live node.

A trainer's sandboxes are spread over the nodes, and each node ends the sandboxes bound to a lease by
itself when the lease's heartbeats stop (``core/leases.py``). So the gateway keeps no lease state: it
gives the lease its ID (``X-Aenv-Lease-Id``) and sends the create to every live node, each heartbeat and
the end to every live node, and merges the answers (the ``sandboxes`` count is the sum over the nodes).

- a create that some node refuses is undone on the nodes that took it, and the refusal is the answer;
- a node that was down when the lease was made does not hold it: a create bound to the lease that lands
  there is refused with ``reason: lease_unknown`` and the gateway tries another node (``control.py``);
- a heartbeat or an end is the lease's answer when any node holds it; when none does, the first node's
  refusal (410 ended, 404 unknown) is the answer;
- a node that misses heartbeats (down, partitioned) ends the lease there and kills its sandboxes bound to
  it, which its clients could not reach anyway.
"""

from __future__ import annotations

import asyncio
import secrets
import string
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from aenv.api.auth import require_api_key
from aenv.api.errors import error_response
from aenv.gateway.control import _parsed
from aenv.gateway.control import gateway as _gw
from aenv.gateway.forward import Relayed

router = APIRouter(dependencies=[Depends(require_api_key)])
LEASE_ID_HEADER = "X-Aenv-Lease-Id"  # api.routes_leases
_ALPHABET = string.ascii_lowercase + string.digits


def new_lease_id() -> str:
    """The ID the nodes accept (``core.leases.LEASE_ID``): a letter, then 19 letters or digits."""
    return secrets.choice(string.ascii_lowercase) + "".join(secrets.choice(_ALPHABET) for _ in range(19))


async def _on_every_node(request: Request, body: bytes, extra: dict[str, str] | None = None) -> list[Relayed] | Response:
    """The request on every live node at once; nodes that cannot be reached are left out, as down."""
    gw = _gw(request)
    up = sorted(gw.nodes.up(), key=lambda n: n.id)
    results = await asyncio.gather(*(gw.forwarder.send(request, n, body, extra=extra) for n in up),
                                   return_exceptions=True)  # fmt: skip
    answers = [r for r in results if isinstance(r, Relayed)]
    return answers or gw.none_up(set())


def merge(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """One lease as several nodes describe it: the first node's fields, the sandboxes of all of them,
    ``ended`` when any node ended it (its sandboxes there are gone), the latest expiry."""
    first = dict(answers[0])
    first["sandboxes"] = sum(int(a.get("sandboxes") or 0) for a in answers)
    ended = [a for a in answers if a.get("state") == "ended"]
    if ended:
        first.update(state="ended", endedAt=ended[0].get("endedAt"), endReason=ended[0].get("endReason"))
    expiries = [a["expiresAt"] for a in answers if isinstance(a.get("expiresAt"), int | float)]
    if expiries:
        first["expiresAt"] = max(expiries)
    return first


def _lease_answer(answers: list[Relayed], status: int = 200) -> Response:
    """The merged lease from the nodes that hold it; when none does, the first refusal (410 before 404)."""
    held = [(got, body) for got in answers if got.status in (200, 201) and isinstance(body := _parsed(got.body), dict)]
    if not held:
        refusals = sorted(answers, key=lambda got: got.status != 410)
        return refusals[0].response()
    merged = merge([body for _, body in held])
    if "killed" in merged or "failed" in merged:  # an end: what every node killed, and could not
        merged["killed"] = [sid for _, body in held for sid in body.get("killed", [])]
        merged["failed"] = [f for _, body in held for f in body.get("failed", [])]
    merged["nodes"] = [got.node.id for got, _ in held]
    return JSONResponse(merged, status_code=status)


@router.post("/aenv/leases")
async def create_lease(request: Request) -> Response:
    body = await request.body()
    lease_id = new_lease_id()
    answers = await _on_every_node(request, body, {LEASE_ID_HEADER: lease_id})
    if isinstance(answers, Response):
        return answers
    refused = next((got for got in answers if got.status != 201), None)
    if refused is not None:
        made = [got.node for got in answers if got.status == 201]
        gw = _gw(request)
        await asyncio.gather(*(gw.forwarder.send(request, n, b"", path=f"/aenv/leases/{lease_id}", method="DELETE")
                               for n in made), return_exceptions=True)  # fmt: skip
        said = _parsed(refused.body)
        message = said.get("message") if isinstance(said, dict) else None
        return error_response(refused.status, f"node {refused.node.id}: {message or refused.body[:200]!r}", None,
                              node=refused.node.id)  # fmt: skip
    return _lease_answer(answers, 201)


@router.get("/aenv/leases")
async def list_leases(request: Request) -> Response:
    answers = await _on_every_node(request, b"")
    if isinstance(answers, Response):
        return answers
    by_id: dict[str, list[dict[str, Any]]] = {}
    for got in answers:
        if got.status != 200:
            return got.response()
        for lease in _parsed(got.body) or []:
            by_id.setdefault(str(lease.get("leaseID")), []).append(lease)
    merged = [merge(same) for same in by_id.values()]
    merged.sort(key=lambda lease: float(lease.get("createdAt") or 0), reverse=True)
    return JSONResponse(merged)


@router.get("/aenv/leases/{lease_id}")
@router.post("/aenv/leases/{lease_id}/heartbeat")
@router.delete("/aenv/leases/{lease_id}")
async def one_lease(request: Request, lease_id: str) -> Response:
    answers = await _on_every_node(request, await request.body())
    if isinstance(answers, Response):
        return answers
    return _lease_answer(answers)

"""The console's operations reads (``api/routes_console_ops.py``) over every node: run counters summed,
build lists joined (a build is replayed on every node under one ID: it is listed once, its status the
gateway's rule for builds: ``error`` when any node's failed, ``ready`` when every node's is)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from aenv.api.auth import require_api_key
from aenv.gateway.control import _down_headers
from aenv.gateway.per_node import _answers, merged_answers

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.get("/aenv/runs")
async def runs(request: Request) -> Response:
    return await merged_answers(request, merge_runs)


def merge_runs(good: dict[str, Any]) -> dict[str, Any]:
    """Several nodes' run counters as one: each counter summed over the nodes."""
    out: dict[str, Any] = {"runKey": None, "runs": {}}
    for answer in good.values():
        out["runKey"] = out["runKey"] or answer.get("runKey")
        for run, parts in (answer.get("runs") or {}).items():
            into = out["runs"].setdefault(run, {"events": {}, "refused": {}})
            for part in ("events", "refused"):
                for k, n in (parts.get(part) or {}).items():
                    into[part][k] = into[part].get(k, 0) + int(n)
    return out


@router.get("/aenv/builds")
async def builds(request: Request) -> Response:
    got = await _answers(request)
    if isinstance(got, Response):
        return got
    good, skipped, _ = got
    return JSONResponse(merge_builds(good), headers=_down_headers(skipped))


def merge_builds(good: dict[str, Any]) -> list[dict[str, Any]]:
    """Nodes' build lists joined by build ID, each naming the nodes that ran it and their statuses."""
    by_id: dict[str, dict[str, Any]] = {}
    for node, answer in sorted(good.items()):
        for b in answer if isinstance(answer, list) else ():
            into = by_id.setdefault(b["buildID"], {**b, "nodes": {}})
            into["nodes"][node] = b.get("status")
    for b in by_id.values():
        statuses = set(b["nodes"].values())
        b["status"] = "error" if "error" in statuses else "ready" if statuses == {"ready"} else "building"
    return sorted(by_id.values(), key=lambda b: b.get("startedAt") or "", reverse=True)

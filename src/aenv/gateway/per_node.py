"""What every node keeps for itself, seen through the gateway: the image cache (``/aenv/cache``: list,
pin, prune), the lifecycle webhooks' receivers and delivery log (``/aenv/webhooks``) and the teams' holdings
(``/aenv/teams``).

Each request goes to every live node at once and the answers are merged into the shape one node gives,
so ``aenv cache ls`` and friends work unchanged against a gateway: sizes and counts summed, lists joined
(each entry naming its ``node``), and every node's own answer under ``nodes``. Nodes that are down, or
that did not answer, are named in ``X-Aenv-Nodes-Down`` and ``nodesDown``. A pin reaches every node
that has the template; it is an error only when none could pin it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from aenv.api.auth import require_api_key
from aenv.api.errors import error_response
from aenv.gateway.control import _down_headers, _parsed, gateway
from aenv.gateway.forward import Relayed
from aenv.gateway.nodes import Node

router = APIRouter(dependencies=[Depends(require_api_key)])


async def _everywhere(request: Request) -> tuple[list[tuple[Node, Relayed]], list[Node]] | Response:
    """Every live node's answer to this request (the body relayed as is), and the nodes skipped."""
    gw = gateway(request)
    up, skipped = gw.nodes.up(), gw.nodes.down()
    if not up:
        return gw.none_up(set())
    body = await request.body()
    results = await asyncio.gather(*(gw.forwarder.send(request, n, body) for n in up), return_exceptions=True)
    answered: list[tuple[Node, Relayed]] = []
    for node, res in zip(up, results, strict=True):
        if isinstance(res, Relayed):
            answered.append((node, res))
        else:
            skipped.append(node)
    return answered, skipped


async def _answers(request: Request) -> tuple[dict[str, Any], list[Node], list[str]] | Response:
    """Every live node's 2xx JSON answer by node id, the nodes skipped and one line per refusal; or
    the answer to give at once: no node up, or the first refusal when no node answered 2xx."""
    got = await _everywhere(request)
    if isinstance(got, Response):
        return got
    answered, skipped = got
    good, refused = _ok(answered)
    return (good, skipped, refused) if good else answered[0][1].response()


def _ok(answered: list[tuple[Node, Relayed]]) -> tuple[dict[str, Any], list[str]]:
    """The 2xx JSON answers by node id, and one line per node that refused."""
    good: dict[str, Any] = {}
    refused: list[str] = []
    for node, res in answered:
        body = _parsed(res.body)
        if 200 <= res.status < 300 and body is not None:
            good[node.id] = body
        else:
            message = body.get("message") if isinstance(body, dict) else None
            refused.append(f"node {node.id}: {res.status} {message if message else repr(res.body[:200])}")
    return good, refused


def _merged(payload: dict[str, Any], good: dict[str, Any], skipped: list[Node], refused: list[str]) -> JSONResponse:
    out = {**payload, "nodes": good, "nodesDown": [n.id for n in skipped]}
    if refused:
        out["refused"] = refused
    return JSONResponse(out, headers=_down_headers(skipped))


async def merged_answers(request: Request, merge: Callable[[dict[str, Any]], dict[str, Any]]) -> Response:
    """Every live node's 2xx answer, merged by ``merge`` into the shape one node gives, with each node's
    own answer and the nodes skipped (``_merged``); or the answer to give at once (``_answers``)."""
    got = await _answers(request)
    if isinstance(got, Response):
        return got
    good, skipped, refused = got
    return _merged(merge(good), good, skipped, refused)


def _tagged(items: list[dict[str, Any]], node: str) -> list[dict[str, Any]]:
    return [{**item, "node": node} for item in items]


def _sum(good: dict[str, Any], *path: str) -> int:
    total = 0
    for answer in good.values():
        value: Any = answer
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        total += value if isinstance(value, int) else 0
    return total


def merge_cache(good: dict[str, Any]) -> dict[str, Any]:
    """``GET /aenv/cache`` of several nodes as one: usage summed, entries and lazy images joined."""
    usage = {k: _sum(good, "usage", k) for k in ("used", "budget", "pinned", "entries")}
    lazy_of = {n: a.get("lazy") or {} for n, a in good.items()}
    return {
        "usage": usage,
        "entries": [e for n, a in good.items() for e in _tagged(a.get("entries") or [], n)],
        "lazy": {
            "lazy_images": all(bool(v.get("lazy_images")) for v in lazy_of.values()),
            "lazy_images_reason": "; ".join(sorted({str(v.get("lazy_images_reason", "")) for v in lazy_of.values()})),
            "budget": sum(int(v.get("budget") or 0) for v in lazy_of.values()),
            "images": [i for n, v in lazy_of.items() for i in _tagged(v.get("images") or [], n)],
        },
    }


@router.get("/aenv/cache")
async def cache_ls(request: Request) -> Response:
    return await merged_answers(request, merge_cache)


@router.post("/aenv/cache/pin/{template}")
async def cache_pin(request: Request, template: str) -> Response:
    return await merged_answers(request, lambda good: {
        "pinned": all(bool(a.get("pinned")) for a in good.values()), "cached": _sum(good, "cached"),
        "stored": _sum(good, "stored")})  # fmt: skip


@router.post("/aenv/cache/prune")
async def cache_prune(request: Request) -> Response:
    return await merged_answers(request, lambda good: {
        "removed": [r for a in good.values() for r in a.get("removed") or []], "freed": _sum(good, "freed")})


@router.get("/aenv/webhooks")
async def webhooks(request: Request) -> Response:
    return await merged_answers(request, merge_webhooks)


def merge_webhooks(good: dict[str, Any]) -> dict[str, Any]:
    """Every node's receivers; the settings every node shares, as the first tells them."""
    first = next(iter(good.values()))
    return {"urls": sorted({u for a in good.values() for u in a.get("urls") or []}),
            "signed": all(bool(a.get("signed")) for a in good.values()), "events": first.get("events"),
            "attempts": first.get("attempts")}  # fmt: skip


@router.get("/aenv/webhooks/deliveries")
async def deliveries(request: Request) -> Response:
    """Every node's deliveries, newest first, cut to ``limit`` (each node already applied it and the
    state filter): a list, as from one node, each delivery naming its node."""
    got = await _answers(request)
    if isinstance(got, Response):
        return got
    good, skipped, _ = got
    try:
        limit = int(request.query_params.get("limit", "100"))
    except ValueError:
        return error_response(400, "limit: an integer", None)
    joined = [d for n, a in good.items() if isinstance(a, list) for d in _tagged(a, n)]
    joined.sort(key=lambda d: float(d.get("createdAt") or 0), reverse=True)
    return JSONResponse(joined[:limit], headers=_down_headers(skipped))


@router.get("/aenv/teams")
async def teams(request: Request) -> Response:
    """Each team's holdings summed over the nodes (a node's own shape: ``aenv teams`` works unchanged);
    the quotas are the same settings on every node, taken from the first answer."""
    got = await _answers(request)
    if isinstance(got, Response):
        return got
    good, skipped, _ = got
    merged: dict[str, dict[str, Any]] = {}
    for answer in good.values():
        for t in answer if isinstance(answer, list) else ():
            into = merged.setdefault(t["team"], {"team": t["team"], "usage": dict.fromkeys(t["usage"], 0),
                                                 "quota": t["quota"], "refused": {}})  # fmt: skip
            for k, v in t["usage"].items():
                into["usage"][k] += v
            for q, n in t["refused"].items():
                into["refused"][q] = into["refused"].get(q, 0) + n
    return JSONResponse([merged[k] for k in sorted(merged)], headers=_down_headers(skipped))

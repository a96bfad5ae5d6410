"""The console's read routes (``api/routes_console.py``) over every node: events merged into one stream,
summaries summed, checkpoint graphs joined. Each item names its ``node``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from aenv.api import sse
from aenv.api.auth import presented_key, require_api_key
from aenv.gateway.control import gateway
from aenv.gateway.nodes import Node
from aenv.gateway.per_node import _answers, merged_answers

log = logging.getLogger("aenv.gateway")
router = APIRouter(dependencies=[Depends(require_api_key)])


@router.get("/aenv/sandboxes/summary")
async def summary(request: Request) -> Response:
    return await merged_answers(request, merge_summaries)


def merge_summaries(good: dict[str, Any]) -> dict[str, Any]:
    """Several nodes' summaries as one, with each node's total under ``byNode``."""
    out: dict[str, Any] = {"total": 0, "byState": {}, "byTemplate": {}, "byRun": {}, "byNode": {}, "runKey": None}
    for node, answer in good.items():
        out["total"] += int(answer.get("total") or 0)
        out["byNode"][node] = int(answer.get("total") or 0)
        out["runKey"] = out["runKey"] or answer.get("runKey")
        for part in ("byState", "byTemplate"):
            for k, n in (answer.get(part) or {}).items():
                out[part][k] = out[part].get(k, 0) + int(n)
        for run, states in (answer.get("byRun") or {}).items():
            per = out["byRun"].setdefault(run, {})
            for k, n in states.items():
                per[k] = per.get(k, 0) + int(n)
    return out


@router.get("/aenv/checkpoints")
async def checkpoints(request: Request) -> Response:
    got = await _answers(request)
    if isinstance(got, Response):
        return got
    good, skipped, refused = got
    return JSONResponse({**merge_graphs(good), "nodesDown": [n.id for n in skipped], "refused": refused})


def merge_graphs(good: dict[str, Any]) -> dict[str, Any]:
    """Nodes' checkpoint graphs joined (a template drawn once)."""
    nodes: dict[str, dict[str, Any]] = {}
    edges: list[dict[str, Any]] = []
    for node, answer in good.items():
        for n in answer.get("nodes") or []:
            nodes.setdefault(n["id"], n if n.get("kind") == "template" else {**n, "node": node})
        edges += answer.get("edges") or []
    return {"nodes": list(nodes.values()), "edges": edges,
            "truncated": any(bool(a.get("truncated")) for a in good.values())}  # fmt: skip


@router.get("/aenv/events")
async def events(request: Request) -> StreamingResponse:
    """Every live node's event stream, merged; a node's stream that ends ends this one (the browser
    reconnects and reloads, as after any gap)."""
    gw = gateway(request)
    key = presented_key(request)
    client: httpx.AsyncClient = request.app.state.console_client
    return sse.response(_merged_events(client, gw.nodes.up(), key))


async def _merged_events(client: httpx.AsyncClient, nodes: list[Node], key: str | None) -> AsyncIterator[bytes]:
    queue: asyncio.Queue[bytes | None] = asyncio.Queue(4096)
    headers = {"X-API-Key": key} if key else {}

    async def follow(node: Node) -> None:
        try:
            async with client.stream("GET", f"{node.url}/aenv/events", headers=headers,
                                     timeout=httpx.Timeout(5.0, read=None)) as resp:  # fmt: skip
                event = ""
                async for line in resp.aiter_lines():
                    if line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("data:") and event == "lifecycle":
                        await queue.put(sse.frame("lifecycle", {**json.loads(line[5:]), "node": node.id}))
                    elif line.startswith("data:") and event == "resync":
                        await queue.put(sse.RESYNC)
        except (httpx.HTTPError, ValueError) as exc:
            log.info("console events from node %s ended: %r", node.id, exc)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(follow(n)) for n in nodes]
    try:
        async for chunk in sse.frames(queue):  # a node's stream that ends (None) ends this one
            yield chunk
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

"""Read routes the console needs beyond E2B's API (documented in the REST reference; public, like the rest).

* ``GET /aenv/events`` — lifecycle events as Server-Sent Events (created, paused, resumed, forked,
  killed), the request's team's only; what a live table updates from without polling.
* ``GET /aenv/sandboxes/summary`` — counts by state, by template and by run (the ``admission_group_key``
  metadata value), for the totals above the sandbox table.
* ``GET /aenv/checkpoints`` — the checkpoint tree as a graph (``api/checkpoints.py``), whole or the tree
  that holds ``root``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse

from aenv.api import sse
from aenv.api.auth import principal, require_api_key
from aenv.api.checkpoints import graph
from aenv.api.deps import orchestrator
from aenv.api.routes_sandboxes import parse_metadata_filter
from aenv.api.serialize import iso
from aenv.core.orchestrator import Orchestrator
from aenv.store.sqlite import SandboxRow

router = APIRouter(dependencies=[Depends(require_api_key)])

QUEUE = 2048  # events a slow reader may fall behind by before it is told to reload (``event: resync``)


class EventHub:
    """Fans the orchestrator's lifecycle events out to the open event streams, each its team's own."""

    def __init__(self) -> None:
        self.readers: set[tuple[asyncio.Queue[bytes | None], str | None]] = set()
        self.loop: asyncio.AbstractEventLoop | None = None

    def on_event(self, event: str, row: SandboxRow, extra: dict[str, str]) -> None:
        if not self.readers or self.loop is None:
            return
        # what a table needs to show the sandbox without asking (the list item's fields)
        item = {"event": event, "sandboxID": row.id, "templateID": row.template_id, "alias": row.alias,
                "state": str(row.state), "metadata": row.metadata, "startedAt": iso(row.started_at),
                "endAt": iso(row.end_at), "cpuCount": row.cpu_count, "memoryMB": row.memory_mb,
                "at": iso(time.time()), **extra}  # fmt: skip
        self.loop.call_soon_threadsafe(self._deliver, row.owner, sse.frame("lifecycle", item))

    def _deliver(self, owner: str, data: bytes) -> None:
        for queue, team in list(self.readers):
            if team is not None and owner != team:
                continue
            if queue.full():
                with contextlib.suppress(asyncio.QueueEmpty):
                    while True:
                        queue.get_nowait()
                queue.put_nowait(sse.RESYNC)  # the reader missed events: it reloads
            else:
                queue.put_nowait(data)

    async def stream(self, team: str | None) -> AsyncIterator[bytes]:
        self.loop = asyncio.get_running_loop()
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(QUEUE)
        entry = (queue, team)
        self.readers.add(entry)
        try:
            async for chunk in sse.frames(queue):
                yield chunk
        finally:
            self.readers.discard(entry)


def hub(request: Request) -> EventHub:
    found: EventHub = request.app.state.console_events
    return found


@router.get("/aenv/events")
async def events(request: Request) -> StreamingResponse:
    who = principal(request)
    return sse.response(hub(request).stream(None if who.admin else who.team))


@router.get("/aenv/sandboxes/summary")
async def summary(request: Request, orch: Orchestrator = Depends(orchestrator),
                  metadata: str | None = Query(None, max_length=4096)) -> JSONResponse:  # fmt: skip
    who = principal(request)
    wanted = parse_metadata_filter(metadata)
    run_key = request.app.state.settings.admission_group_key
    by_state: dict[str, int] = {}
    by_template: dict[str, int] = {}
    by_run: dict[str, dict[str, int]] = {}
    for sbx in orch.table:
        row = sbx.row
        if not who.sees(row.owner) or any(row.metadata.get(k) != v for k, v in wanted.items()):
            continue
        if (shown := sbx.state.shown) is None:
            continue  # starting or being killed: not listed either
        state = str(shown)
        by_state[state] = by_state.get(state, 0) + 1
        by_template[row.template_id] = by_template.get(row.template_id, 0) + 1
        if run_key and (run := row.metadata.get(run_key)) is not None:
            per = by_run.setdefault(run, {})
            per[state] = per.get(state, 0) + 1
    return JSONResponse({"total": sum(by_state.values()), "byState": by_state, "byTemplate": by_template,
                         "runKey": run_key, "byRun": by_run})  # fmt: skip


@router.get("/aenv/checkpoints")
async def checkpoints(request: Request, orch: Orchestrator = Depends(orchestrator),
                      root: str | None = Query(None, max_length=128)) -> JSONResponse:  # fmt: skip
    who = principal(request)
    snaps = [
        {"id": r.id, "parentID": r.parent_id, "sandboxID": r.sandbox_id, "templateID": r.template_id,
         "name": r.name, "mode": str(r.mode), "internal": r.internal, "createdAt": iso(r.created_at)}
        for r in orch.snapshots.list_snapshots(include_internal=True) if who.sees(r.owner)
    ]  # fmt: skip
    boxes = [
        {"id": s.id, "lineageHead": s.row.lineage_head, "templateID": s.row.template_id, "state": str(s.state.shown),
         "metadata": s.row.metadata}
        for s in orch.table if who.sees(s.row.owner)
    ]  # fmt: skip
    return JSONResponse(graph(snaps, boxes, root))

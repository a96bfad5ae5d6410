"""What a simulated node answers to the console's reads, so that the console runs through the real gateway
over simulated nodes (``bench/console_sim.py``): the paged list (``GET /v2/sandboxes``: ``limit``,
``nextToken`` = the last ID given, ``state``, ``metadata``, ``template``, ``order``, as the real node's
``Orchestrator.list_sandboxes``), the summary (``/aenv/sandboxes/summary``), the batch metrics
(``/sandboxes/metrics``) and the lifecycle event stream (``/aenv/events``: the frames a real node's
``EventHub`` writes, each item the fields a table row needs).

Pure functions over the node's sandboxes, and an event hub of asyncio queues; ``simnode.py`` routes to
them. Keys are not checked (a sim node serves the gateway alone): every reader sees every sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import random
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote_plus

from aenv.api import sse  # the real node's frames (that module imports FastAPI only to answer with them)
from aenv.api.sse import RESYNC, frame

MAX_LIMIT = 100  # the real node's MAX_LIST_LIMIT
MAX_BATCH_IDS = 100  # sandboxes in one GET /sandboxes/metrics, as on a real node
QUEUE = 2048  # events a slow reader may fall behind by before it is told to reload (as the real hub)
STATES = ("running", "paused")
EVENT_FIELDS = ("sandboxID", "templateID", "alias", "metadata", "startedAt", "endAt", "cpuCount", "memoryMB")


def iso(ts: float) -> str:
    """The real node's timestamps: UTC with microseconds (the gateway merges pages by this string)."""
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class SimSandbox:
    id: str
    template: str
    started_at: float
    token: str
    metadata: dict[str, str] = field(default_factory=dict)
    state: str = "running"  # or "paused"
    timeout_s: float = 3600.0
    seq: int = 0  # the node's creation order: ties of started_at broken as the real table does

    def listed(self, node_id: str) -> dict[str, Any]:
        """A list item (and a lifecycle event's fields), as the real node serializes one."""
        return {"sandboxID": self.id, "templateID": self.template, "alias": self.template, "clientID": node_id,
                "envdVersion": "0.2.0", "startedAt": iso(self.started_at),
                "endAt": iso(self.started_at + self.timeout_s), "cpuCount": 1, "memoryMB": 512,
                "diskSizeMB": 1024, "metadata": self.metadata, "state": self.state}  # fmt: skip

    def describe(self, node_id: str) -> dict[str, Any]:
        """``GET /sandboxes/{id}`` and a create's answer: the list item and the envd token."""
        return {**self.listed(node_id), "envdAccessToken": self.token, "domain": None}


class BadQuery(ValueError):
    """A filter the real node answers 400 to."""


def query_of(raw: str) -> dict[str, str]:
    return {k: v[0] for k, v in parse_qs(raw, keep_blank_values=True).items()}


def metadata_filter(raw: str | None) -> dict[str, str]:
    """The SDKs' double-encoded ``metadata`` query value, decoded as the real node does."""
    pairs = [p.split("=") for p in unquote_plus(raw or "").split("&") if p]
    if bad := next((p for p in pairs if len(p) != 2), None):
        raise BadQuery(f"invalid metadata filter: '{'='.join(bad)}' is not key=value")
    return {unquote_plus(k): unquote_plus(v) for k, v in pairs}


def states(raw: str | None) -> set[str]:
    if not raw:
        return set(STATES)
    got = {s.strip() for s in raw.split(",")}
    if bad := got - set(STATES):
        raise BadQuery(f"invalid state '{sorted(bad)[0]}': use running and/or paused")
    return got


def matching(sandboxes: Iterable[SimSandbox], q: dict[str, str]) -> list[SimSandbox]:
    """The sandboxes a list or summary query selects (state, metadata, template)."""
    wanted, meta, template = states(q.get("state")), metadata_filter(q.get("metadata")), q.get("template")
    return [s for s in sandboxes
            if s.state in wanted and all(s.metadata.get(k) == v for k, v in meta.items())
            and (not template or template == s.template)]  # fmt: skip


def list_page(sandboxes: Iterable[SimSandbox], q: dict[str, str]) -> tuple[list[SimSandbox], str | None]:
    """One page of ``GET /v2/sandboxes``: newest first (``order=asc``: oldest), after ``nextToken``'s ID,
    ``limit`` items (1..100, default 100), and the token of the next page (its last ID) when more follow."""
    raw = q.get("limit") or str(MAX_LIMIT)
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIMIT:
        raise BadQuery(f"limit: an integer from 1 to {MAX_LIMIT}")
    if q.get("order", "desc") not in ("asc", "desc"):
        raise BadQuery("order: asc or desc")
    items = sorted(matching(sandboxes, q), key=lambda s: (s.started_at, s.seq), reverse=q.get("order") != "asc")
    if after := q.get("nextToken"):
        ids = [s.id for s in items]
        if after in ids:
            items = items[ids.index(after) + 1:]
    page = items[: int(raw)]
    return page, (page[-1].id if len(items) > len(page) and page else None)


def summary(sandboxes: Iterable[SimSandbox], q: dict[str, str], run_key: str | None = "run") -> dict[str, Any]:
    """``/aenv/sandboxes/summary``: counts by state, template and run (the ``run_key`` metadata value)."""
    by_state: dict[str, int] = {}
    by_template: dict[str, int] = {}
    by_run: dict[str, dict[str, int]] = {}
    for s in matching(sandboxes, {"metadata": q.get("metadata", "")}):
        by_state[s.state] = by_state.get(s.state, 0) + 1
        by_template[s.template] = by_template.get(s.template, 0) + 1
        if run_key and (run := s.metadata.get(run_key)) is not None:
            per = by_run.setdefault(run, {})
            per[s.state] = per.get(s.state, 0) + 1
    return {"total": sum(by_state.values()), "byState": by_state, "byTemplate": by_template, "runKey": run_key,
            "byRun": by_run}  # fmt: skip


def metrics(sandboxes: dict[str, SimSandbox], raw_ids: str, rng: random.Random) -> dict[str, Any]:
    """``GET /sandboxes/metrics?sandbox_ids=a,b``: a sampled latest sample per sandbox this node holds
    (unknown IDs left out, as E2B does)."""
    ids = [i for i in dict.fromkeys(x.strip() for x in raw_ids.split(",")) if i]
    if not ids:
        raise BadQuery("sandbox_ids: name at least one sandbox (comma-separated)")
    if len(ids) > MAX_BATCH_IDS:
        raise BadQuery(f"sandbox_ids: at most {MAX_BATCH_IDS} sandboxes, got {len(ids)}")
    now = time.time()
    out = {}
    for sid in ids:
        if sid in sandboxes:
            out[sid] = {"timestamp": iso(now), "timestampUnix": int(now), "cpuCount": 1,
                        "cpuUsedPct": round(rng.uniform(0, 30), 2), "memUsed": rng.randrange(20, 120) << 20,
                        "memTotal": 512 << 20, "memCache": 0, "diskUsed": 64 << 20, "diskTotal": 1024 << 20}  # fmt: skip
    return {"sandboxes": out}


class SimEvents:
    """The node's lifecycle events, fanned out to its open ``/aenv/events`` streams (the gateway holds one
    per node while a console is open)."""

    def __init__(self) -> None:
        self.readers: set[asyncio.Queue[bytes | None]] = set()
        self.sent = 0

    def emit(self, event: str, sbx: SimSandbox, node_id: str) -> None:
        if not self.readers:
            return
        state = "killed" if event == "killed" else sbx.state
        item = sbx.listed(node_id)  # the real hub's fields (api/routes_console.py), no more
        data = frame("lifecycle", {"event": event, **{k: item[k] for k in EVENT_FIELDS}, "state": state,
                                   "at": iso(time.time())})  # fmt: skip
        for queue in list(self.readers):
            if queue.full():  # the reader fell behind: it is told to reload
                with contextlib.suppress(asyncio.QueueEmpty):
                    while True:
                        queue.get_nowait()
                queue.put_nowait(RESYNC)
            else:
                queue.put_nowait(data)
            self.sent += 1

    def close(self) -> None:
        """End every stream (the node dies): the gateway's merged stream ends with it."""
        for queue in list(self.readers):
            with contextlib.suppress(asyncio.QueueEmpty):
                while queue.full():
                    queue.get_nowait()
            queue.put_nowait(None)

    async def stream(self, keepalive_s: float = sse.KEEPALIVE_S) -> AsyncIterator[bytes]:
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(QUEUE)
        self.readers.add(queue)
        try:
            async for chunk in sse.frames(queue, keepalive_s):
                yield chunk
        finally:
            self.readers.discard(queue)


@dataclass
class Headed:
    """A JSON body with headers of its own (the list's ``X-Next-Token``)."""

    body: Any
    headers: dict[str, str]


@dataclass
class Stream:
    """A streamed answer (``text/event-stream``, chunked) instead of a JSON body."""

    chunks: AsyncIterator[bytes]
    media_type: str = "text/event-stream"


async def stream_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, status: int,
                        answer: Stream) -> None:  # fmt: skip
    """A chunked streamed response until the stream ends or the client goes (its EOF, or anything it
    sends: the next request on a stream's connection is not served)."""
    writer.write((f"HTTP/1.1 {status} {'OK' if status == 200 else 'Status'}\r\ncontent-type: {answer.media_type}\r\n"
                  "cache-control: no-cache\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n").encode())
    gone = asyncio.ensure_future(reader.read(1))
    chunks = answer.chunks.__aiter__()
    try:
        await writer.drain()
        while True:
            nxt = asyncio.ensure_future(anext(chunks))
            await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                nxt.cancel()
                return
            try:
                data = nxt.result()
            except StopAsyncIteration:
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                return
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()
    finally:
        gone.cancel()
        with contextlib.suppress(Exception):
            await chunks.aclose()  # type: ignore[attr-defined]

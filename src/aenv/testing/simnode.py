"""Simulated ``aenv serve`` nodes for the cluster simulation (``bench/cluster_sim.py``): one asyncio process
hosting many nodes, each with its own HTTP listener on 127.0.0.1, registered in the real Redis directory
with the real scripts (``aenv.directory.node.NodeDirectory``), answering the node API the gateway calls.

What each node answers (the calls ``aenv.gateway`` makes): ``/health``; ``/aenv/info`` (sandbox counts,
``starting``, ``warm``: its warm pool per template); ``POST /sandboxes`` and ``/v2/sandboxes`` (a sampled
start latency, a hand-out from the warm pool when it has one of the template, 429 ``reason: capacity``
past its capacity, as the real admission; the sandbox is bound in the directory before the answer, as a
real node's store does); ``GET``/``DELETE /sandboxes/{id}``, pause and resume, and the sandbox's other
sub-routes; ``/templates`` and ``/snapshots`` (empty); and the console's reads (``simnode_reads.py``): the
paged list, the summary, the batch metrics, the lifecycle event stream (``/aenv/events``) and the kill by
metadata. Sandboxes are dict entries: nothing runs.

Nodes can be killed (the listener and every open connection closed, heartbeats stop) and brought back (a
new incarnation registers: what the directory bound to the old one is no longer its own, and it starts
empty, as a real node kills what it no longer owns). A ``SimController`` stands in for Ray's health
checks: a node whose heartbeat is older than ``failures × period`` is declared dead with the directory's
real ``mark_dead`` (its bindings fenced: lost).

An admin listener (``--admin-port``) drives it: ``GET /stats``, ``POST /kill?node=ID``,
``POST /revive?node=ID``, ``POST /join?count=K``, ``POST /fill?count=K[&metadata=k%3Dv]`` (sandboxes made in place, bound
in pipelined batches: directory memory at 100,000 sandboxes without 100,000 relayed creates),
``POST /clear``.

    python -m aenv.testing.simnode --nodes 100 --base-port 31000 --redis redis://127.0.0.1:6379 --admin-port 30999
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import resource
import secrets
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

import redis

from aenv import __version__
from aenv.directory import keys
from aenv.directory.node import DirectoryError, NodeDirectory, connect, mark_dead
from aenv.testing import simnode_reads as reads
from aenv.testing.simnode_reads import Headed, SimEvents, SimSandbox, Stream

log = logging.getLogger("aenv.simnode")

MAX_HEAD = 64 * 1024
Answer = tuple[int, Any]  # status, JSON body (None: no body)


@dataclass(frozen=True)
class SimConfig:
    """How simulated nodes behave. Latencies in ms, sampled uniformly; capacities per node, sampled."""

    create_ms: tuple[float, float] = (15.0, 40.0)  # a start (restore of a template)
    warm_ms: tuple[float, float] = (2.0, 5.0)  # a hand-out from the warm pool
    call_ms: tuple[float, float] = (0.2, 1.0)  # any other call (a read of the node's table)
    capacity: tuple[int, int] = (100, 400)  # live sandboxes a node admits (then 429 capacity)
    templates: int = 20  # templates t0..t{n-1} in the cluster
    warm_per_node: int = 3  # templates a node keeps a warm pool of
    pool_size: int = 2  # warm sandboxes per warm template
    refill_s: float = 0.5  # a pool entry comes back this long after a hand-out
    heartbeat_s: float = 0.5  # controller's health-check period (Ray's, as `aenv cluster local` sets it)
    failures: int = 3  # missed periods before the controller declares a node dead


def templates(n: int) -> list[str]:
    return [f"t{i}" for i in range(n)]


def sample_ms(rng: random.Random, span: tuple[float, float]) -> float:
    """A latency in ms, uniform in ``span``."""
    return rng.uniform(*span)


def warm_set(rng: random.Random, cfg: SimConfig) -> set[str]:
    """The templates a node keeps warm: ``warm_per_node`` of the cluster's, at random."""
    names = templates(cfg.templates)
    return set(rng.sample(names, min(cfg.warm_per_node, len(names))))


def parse_head(head: bytes) -> tuple[str, str, str, dict[str, str]]:
    """``(method, path, query, headers)`` of an HTTP/1.1 request head (header names lowercased).
    Raises ValueError on a malformed one."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise ValueError(f"bad request line: {lines[0]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise ValueError(f"bad header line: {line!r}")
        headers[name.strip().lower()] = value.strip()
    target = urlsplit(parts[1])
    return parts[0].upper(), target.path, target.query, headers


REASONS = {200: "OK", 201: "Created", 204: "No Content", 400: "Bad Request", 404: "Not Found", 429: "Too Many Requests",
           503: "Service Unavailable"}  # fmt: skip


def encode_answer(status: int, body: Any, keep_alive: bool = True) -> bytes:
    """An HTTP/1.1 response with a JSON body (none for 204 or ``None``; ``Headed``: with its headers)."""
    extra = body.headers if isinstance(body, Headed) else {}
    body = body.body if isinstance(body, Headed) else body
    data = b"" if body is None or status == 204 else json.dumps(body, separators=(",", ":")).encode()
    head = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}", f"content-length: {len(data)}"]
    if data:
        head.append("content-type: application/json")
    head += [f"{k}: {v}" for k, v in extra.items()]
    if not keep_alive:
        head.append("connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + data


def capacity_refusal(node_id: str, live: int, capacity: int) -> Answer:
    """The real admission's answer past capacity: the gateway tries another node on it."""
    return 429, {"code": 429, "message": f"node {node_id} is full ({live} of {capacity} sandboxes); retry later",
                 "reason": "capacity"}  # fmt: skip


def not_found(sandbox_id: str) -> Answer:
    return 404, {"code": 404, "message": f"sandbox '{sandbox_id}' not found"}


async def serve_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     handle: Any) -> None:  # fmt: skip
    """Keep-alive HTTP/1.1 on one connection: ``await handle(method, path, query, headers, body) -> Answer``."""
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                return
            try:
                method, path, query, headers = parse_head(head[:-4])
            except ValueError as exc:
                writer.write(encode_answer(400, {"code": 400, "message": str(exc)}, keep_alive=False))
                return
            if headers.get("transfer-encoding", "").lower() == "chunked":
                writer.write(encode_answer(400, {"code": 400, "message": "chunked bodies are not simulated"}, False))
                return
            body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
            status, answer = await handle(method, path, query, headers, body)
            if isinstance(answer, Stream):
                await reads.stream_answer(reader, writer, status, answer)
                return  # a stream ends its connection
            keep = headers.get("connection", "").lower() != "close"
            writer.write(encode_answer(status, answer, keep_alive=keep))
            await writer.drain()
            if not keep:
                return
    except (ConnectionError, asyncio.IncompleteReadError):
        return
    finally:
        with contextlib.suppress(Exception):
            writer.close()


@dataclass
class SimNode:
    """One simulated node: its listener, its sandboxes, its warm pool, and its directory record."""

    id: str
    port: int
    cfg: SimConfig
    client: redis.Redis
    rng: random.Random
    capacity: int = 0
    warm: set[str] = field(default_factory=set)
    pool: dict[str, int] = field(default_factory=dict)
    sandboxes: dict[str, SimSandbox] = field(default_factory=dict)
    starting: int = 0
    alive: bool = False
    beat: float = 0.0  # last heartbeat (monotonic)
    creates: int = 0
    warm_set_hits: int = 0  # creates of a template this node keeps warm
    handouts: int = 0  # creates served from the warm pool
    refused: int = 0
    server: asyncio.Server | None = None
    writers: set[asyncio.StreamWriter] = field(default_factory=set)
    directory: NodeDirectory | None = None
    events: SimEvents = field(default_factory=SimEvents)
    seq: int = 0  # sandboxes made, for the list's order

    def __post_init__(self) -> None:
        self.capacity = self.capacity or self.rng.randint(*self.cfg.capacity)
        self.warm = self.warm or warm_set(self.rng, self.cfg)
        self.pool = {t: self.cfg.pool_size for t in self.warm}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def info(self) -> dict[str, Any]:
        """``/aenv/info`` as a node answers it (what the gateway's probe reads)."""
        out: dict[str, Any] = {"version": __version__, "sandboxes": {"running": len(self.sandboxes)},
                               "starting": self.starting, "waiting": 0, "runtime": "sim",
                               "warm": {t: n for t, n in self.pool.items() if n > 0}}  # fmt: skip
        if self.directory is not None:
            out["cluster"] = {"nodeID": self.id, "incarnation": self.directory.incarnation}
        return out

    def stats(self) -> dict[str, Any]:
        return {"id": self.id, "url": self.url, "alive": self.alive, "sandboxes": len(self.sandboxes),
                "capacity": self.capacity, "creates": self.creates, "warmSetHits": self.warm_set_hits,
                "handouts": self.handouts, "refused": self.refused, "warm": sorted(self.warm)}  # fmt: skip

    # ---- life -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Register a new incarnation (the real ``REGISTER``), then listen."""
        self.directory = NodeDirectory(self.client, self.id, self.url)
        await asyncio.to_thread(self.directory.register)
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", self.port, backlog=512)
        self.alive, self.beat = True, time.monotonic()

    async def kill(self) -> None:
        """Stop answering and heartbeating at once: listener and every connection closed."""
        self.alive = False
        self.events.close()
        if self.server is not None:
            self.server.close()
        for w in list(self.writers):
            w.transport.abort()
        self.writers.clear()
        if self.server is not None:
            await self.server.wait_closed()
            self.server = None

    async def revive(self) -> None:
        """Back as a new incarnation: what it held was fenced (lost) or is no longer its own."""
        self.sandboxes.clear()
        self.starting = 0
        self.pool = {t: self.cfg.pool_size for t in self.warm}
        await self.start()

    # ---- HTTP -------------------------------------------------------------------------------
    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.alive:
            writer.transport.abort()
            return
        self.writers.add(writer)
        try:
            await serve_http(reader, writer, self.handle)
        finally:
            self.writers.discard(writer)

    async def handle(self, method: str, path: str, query: str, headers: dict[str, str], body: bytes) -> Answer:
        if path == "/health":
            return 200, {"status": "ok", "version": __version__}
        if path == "/aenv/info":
            return 200, self.info()
        if path == "/aenv/events" and method == "GET":
            return 200, Stream(self.events.stream())
        await asyncio.sleep(sample_ms(self.rng, self.cfg.call_ms) / 1000)
        try:
            return await self._route(method, path, reads.query_of(query), body)
        except reads.BadQuery as exc:
            return 400, {"code": 400, "message": str(exc)}

    async def _route(self, method: str, path: str, q: dict[str, str], body: bytes) -> Answer:
        parts = [p for p in path.split("/") if p]
        v2 = bool(parts) and parts[0] == "v2"
        parts = parts[1:] if v2 else parts
        if parts == ["sandboxes"]:
            if method == "POST":
                return await self.create(body)
            if v2:
                page, token = reads.list_page(self.sandboxes.values(), q)
                return 200, Headed([s.listed(self.id) for s in page], {"X-Next-Token": token} if token else {})
            listed = reads.matching(self.sandboxes.values(), {**q, "state": "running"})  # legacy: running only
            return 200, [s.listed(self.id) for s in listed]
        if parts == ["sandboxes", "metrics"] and method == "GET":
            return 200, reads.metrics(self.sandboxes, q.get("sandbox_ids", ""), self.rng)
        if path == "/aenv/sandboxes/summary":
            return 200, reads.summary(self.sandboxes.values(), q)
        if (method, path) in (("DELETE", "/aenv/sandboxes"), ("POST", "/aenv/sandboxes/kill")):
            return await self.kill_matching(q, body)
        if len(parts) >= 2 and parts[0] == "sandboxes":
            return await self._one(method, parts[1], parts[2:])
        if parts and parts[0] in ("templates", "snapshots", "default-templates", "volumes"):
            return 200, []
        return 404, {"code": 404, "message": f"{method} {path} is not simulated", "reason": "sim"}

    async def _one(self, method: str, sandbox_id: str, rest: list[str]) -> Answer:
        """A sandbox's own routes: read, kill, pause, resume (connect); any other sub-route reads it."""
        sbx = self.sandboxes.get(sandbox_id)
        if sbx is None:
            return not_found(sandbox_id)
        if method == "DELETE" and not rest:
            await self.remove(sbx.id)
            return 204, None
        if method == "POST" and rest == ["pause"]:
            if sbx.state != "paused":
                sbx.state = "paused"
                self.events.emit("paused", sbx, self.id)
            return 204, None
        if method == "POST" and rest in (["resume"], ["connect"]):
            was = sbx.state
            if was == "paused":
                sbx.state = "running"
                self.events.emit("resumed", sbx, self.id)
            return (201 if was == "paused" else 200), sbx.describe(self.id)
        return 200, sbx.describe(self.id)

    async def kill_matching(self, q: dict[str, str], body: bytes) -> Answer:
        """Every sandbox whose metadata has all the filter's pairs, killed (an empty filter refused)."""
        if q.get("metadata") is not None:
            wanted = reads.metadata_filter(q["metadata"])
        else:
            try:
                wanted = {str(k): str(v) for k, v in dict(json.loads(body or b"{}").get("metadata") or {}).items()}
            except (ValueError, AttributeError, TypeError):
                return 400, {"code": 400, "message": "body: {\"metadata\": {key: value}}"}
        if not wanted:
            return 400, {"code": 400, "message": "metadata: give at least one key=value pair"}
        ids = [s.id for s in self.sandboxes.values() if all(s.metadata.get(k) == v for k, v in wanted.items())]
        for sid in ids:
            await self.remove(sid)
        return 200, {"killed": ids, "failed": []}

    async def create(self, body: bytes) -> Answer:
        try:
            req = json.loads(body or b"{}")
            template = str(req.get("templateID") or "base")
            metadata = {str(k): str(v) for k, v in dict(req.get("metadata") or {}).items()}
            timeout = float(req.get("timeout") or 300)
        except (ValueError, AttributeError, TypeError):
            return 400, {"code": 400, "message": "body: not a JSON object"}
        if len(self.sandboxes) + self.starting >= self.capacity:
            self.refused += 1
            return capacity_refusal(self.id, len(self.sandboxes) + self.starting, self.capacity)
        self.starting += 1
        try:
            if self.pool.get(template, 0) > 0:
                self.pool[template] -= 1
                self.handouts += 1
                asyncio.get_running_loop().call_later(self.cfg.refill_s, self._refill, template)
                await asyncio.sleep(sample_ms(self.rng, self.cfg.warm_ms) / 1000)
            else:
                await asyncio.sleep(sample_ms(self.rng, self.cfg.create_ms) / 1000)
            self.seq += 1
            sbx = SimSandbox("s" + secrets.token_hex(10), template, time.time(), secrets.token_hex(8), metadata,
                             timeout_s=timeout, seq=self.seq)  # fmt: skip
            assert self.directory is not None
            try:  # bound before the answer, as a real node's store does
                await asyncio.to_thread(self.directory.bind, sbx.id)
            except DirectoryError as exc:
                return 503, {"code": 503, "message": f"cluster directory: {exc}"}
        finally:
            self.starting -= 1
        self.sandboxes[sbx.id] = sbx
        self.creates += 1
        self.warm_set_hits += template in self.warm
        self.events.emit("created", sbx, self.id)
        return 201, sbx.describe(self.id)

    def _refill(self, template: str) -> None:
        if self.alive and template in self.pool:
            self.pool[template] = min(self.cfg.pool_size, self.pool[template] + 1)

    async def remove(self, sandbox_id: str) -> None:
        sbx = self.sandboxes.pop(sandbox_id, None)
        if sbx is not None:
            self.events.emit("killed", sbx, self.id)
        if self.directory is not None:
            await asyncio.to_thread(self.directory.unbind, sandbox_id)

    def fill(self, count: int, template: str, metadata: dict[str, str] | None = None) -> list[str]:
        """``count`` sandboxes made in place (no start latency, no events), bound in one pipelined batch
        with the real ``BIND`` script. Blocking: run it in a thread."""
        assert self.directory is not None
        made = [SimSandbox("s" + secrets.token_hex(10), template, time.time(), secrets.token_hex(8),
                           dict(metadata or {}), seq=self.seq + i + 1) for i in range(count)]  # fmt: skip
        self.seq += count
        script = self.client.register_script(keys.BIND)
        pipe = self.client.pipeline(transaction=False)
        for sbx in made:
            script(keys=[keys.node_key(self.id), keys.node_sandboxes_key(self.id), keys.sandbox_key(sbx.id)],
                   args=[self.id, self.directory.incarnation, sbx.id], client=pipe)  # fmt: skip
        pipe.execute()
        for sbx in made:
            self.sandboxes[sbx.id] = sbx
        return [s.id for s in made]


def overdue(beats: Iterable[tuple[str, float]], now: float, period: float, failures: int) -> list[str]:
    """The node ids whose last heartbeat is older than ``failures × period`` (Ray's rule)."""
    return [node_id for node_id, beat in beats if now - beat > failures * period]


class SimController:
    """Stands in for Ray's health checks and aenv's controller: a node's heartbeat is its being alive at
    each tick; one silent for ``failures`` periods is declared dead with the directory's ``mark_dead``."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.declared: dict[str, float] = {}  # node id -> when it was declared dead (wall clock)

    async def run(self) -> None:
        cfg = self.sim.cfg
        while True:
            await asyncio.sleep(cfg.heartbeat_s)
            now = time.monotonic()
            for node in self.sim.nodes.values():
                if node.alive:
                    node.beat = now  # the heartbeat a live node answers
                    self.declared.pop(node.id, None)
            silent = [(n.id, n.beat) for n in self.sim.nodes.values() if not n.alive and n.id not in self.declared]
            for node_id in overdue(silent, now, cfg.heartbeat_s, cfg.failures):
                reason = f"simulated controller: no heartbeat for {cfg.failures} x {cfg.heartbeat_s} s"
                try:
                    lost = await asyncio.to_thread(mark_dead, self.sim.client, node_id, reason)
                except DirectoryError as exc:
                    log.warning("node=%s not declared dead: %s", node_id, exc)
                    continue
                self.declared[node_id] = time.time()
                log.info("node=%s declared dead (%d sandboxes lost)", node_id, lost)


class Sim:
    """The simulated nodes of one process, their controller, and the admin API."""

    def __init__(self, client: redis.Redis, base_port: int, cfg: SimConfig, seed: int = 0) -> None:
        self.client = client
        self.base_port = base_port
        self.cfg = cfg
        self.seed = seed
        self.nodes: dict[str, SimNode] = {}
        self.controller = SimController(self)

    def _new(self, index: int) -> SimNode:
        node_id = f"sim{index:04d}"
        return SimNode(node_id, self.base_port + index, self.cfg, self.client, random.Random(f"{self.seed}:{node_id}"))

    async def join(self, count: int) -> list[str]:
        """``count`` more nodes, on the next ports, registered and listening."""
        start = len(self.nodes)
        fresh = [self._new(start + i) for i in range(count)]
        for chunk in range(0, len(fresh), 100):
            await asyncio.gather(*(n.start() for n in fresh[chunk:chunk + 100]))
        for n in fresh:
            self.nodes[n.id] = n
        return [n.id for n in fresh]

    async def fill(self, count: int, metadata: dict[str, str] | None = None) -> int:
        """``count`` sandboxes spread evenly over the live nodes, made in place (with ``metadata``)."""
        live = [n for n in self.nodes.values() if n.alive]
        if not live:
            return 0
        names = templates(self.cfg.templates)
        per, extra = divmod(count, len(live))
        made = 0
        for i, node in enumerate(live):
            k = per + (i < extra)
            for off in range(0, k, 5000):
                made += len(await asyncio.to_thread(node.fill, min(5000, k - off), names[i % len(names)], metadata))
        return made

    async def clear(self) -> int:
        """Every sandbox removed (unbound), the counters kept."""
        gone = 0
        for node in self.nodes.values():
            ids = list(node.sandboxes)
            node.sandboxes.clear()
            if node.alive and node.directory is not None and ids:
                script = self.client.register_script(keys.UNBIND)
                pipe = self.client.pipeline(transaction=False)
                for sid in ids:
                    script(keys=[keys.node_key(node.id), keys.node_sandboxes_key(node.id), keys.sandbox_key(sid)],
                           args=[node.id, node.directory.incarnation, sid], client=pipe)  # fmt: skip
                await asyncio.to_thread(pipe.execute)
            gone += len(ids)
        return gone

    def stats(self) -> dict[str, Any]:
        nodes = [n.stats() for n in self.nodes.values()]
        return {"nodes": nodes, "declared": dict(self.controller.declared),
                "alive": sum(1 for n in nodes if n["alive"]), "sandboxes": sum(n["sandboxes"] for n in nodes)}  # fmt: skip

    async def admin(self, method: str, path: str, query: str, headers: dict[str, str], body: bytes) -> Answer:
        q = {k: v[0] for k, v in parse_qs(query).items()}
        if path == "/stats":
            return 200, self.stats()
        node = self.nodes.get(q.get("node", ""))
        if path == "/kill" and node is not None:
            await node.kill()
            return 200, {"node": node.id, "at": time.time()}
        if path == "/revive" and node is not None:
            if not node.alive:
                await node.revive()
            return 200, {"node": node.id, "at": time.time(), "incarnation": node.directory.incarnation
                         if node.directory else 0}  # fmt: skip
        if path == "/join":
            return 200, {"joined": await self.join(int(q.get("count", "1")))}
        if path == "/fill":
            meta = reads.metadata_filter(q.get("metadata"))  # e.g. run=X: the fill's sandboxes tagged
            return 200, {"made": await self.fill(int(q.get("count", "0")), meta)}
        if path == "/clear":
            return 200, {"removed": await self.clear()}
        return 404, {"code": 404, "message": f"{method} {path}: unknown (or no such node)"}


def raise_fd_limit() -> int:
    """RLIMIT_NOFILE raised to its hard limit (a listener and its connections per node); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


async def amain(args: argparse.Namespace) -> None:
    raise_fd_limit()
    client = connect(args.redis)
    cfg = SimConfig(templates=args.templates, warm_per_node=args.warm_per_node,
                    capacity=(args.capacity, args.capacity) if args.capacity else SimConfig.capacity)
    sim = Sim(client, args.base_port, cfg, args.seed)
    await sim.join(args.nodes)
    admin = await asyncio.start_server(lambda r, w: serve_http(r, w, sim.admin), "127.0.0.1", args.admin_port)
    ctl = asyncio.create_task(sim.controller.run(), name="sim-controller")
    print(f"simnode: {len(sim.nodes)} nodes on 127.0.0.1:{args.base_port}.., admin on {args.admin_port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    ctl.cancel()
    admin.close()
    for node in sim.nodes.values():
        await node.kill()
    client.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m aenv.testing.simnode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--nodes", type=int, default=10)
    ap.add_argument("--base-port", type=int, required=True, help="node i listens on BASE_PORT + i")
    ap.add_argument("--admin-port", type=int, required=True)
    ap.add_argument("--redis", required=True, help="the cluster directory, redis://HOST:PORT")
    ap.add_argument("--templates", type=int, default=SimConfig.templates)
    ap.add_argument("--warm-per-node", type=int, default=SimConfig.warm_per_node)
    ap.add_argument("--capacity", type=int, default=0, help="live sandboxes each node admits [default: 100-400]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-level", default="warning")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(amain(args))


if __name__ == "__main__":
    main()

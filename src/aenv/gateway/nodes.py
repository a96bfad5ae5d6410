"""The nodes behind a gateway: a static list of ``aenv serve`` URLs, each probed every ``interval`` seconds.

A node is ``up`` while it answers ``/health``; its load comes from ``/aenv/info`` (sandbox counts by
state, creates starting). A refused connection marks it down at once (``mark_down``, called by whoever
saw it), so creates stop going there before the next probe; only a probe that gets an answer brings it
back. The list is fixed at start, or, with a cluster directory (``cluster.py``), follows its node
records: a node it declares dead is ``fenced`` (down whatever its probes say) until a new incarnation.
The report also says what placement weighs besides load (``Node.report``): the node's machine (vm: where
its snapshots restore, ``aenv.machine_key``) and the templates it has warm sandboxes of.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from aenv.machine_key import MachineKey, parse

log = logging.getLogger("aenv.gateway")

PROBE_TIMEOUT = 2.0  # seconds a node has to answer a probe

# The probes' GET: (node, path, headers, timeout) -> (status, body). The gateway's app gives its Forwarder's
# (kept-alive connections, its own HTTP/1.1 codec); raises on a connection that fails or a timeout.
ProbeGet = Callable[[Any, str, dict[str, str], float], Awaitable[tuple[int, bytes]]]


LOST_KEPT = 200  # lost sandbox IDs a node's record keeps (the count is exact)


@dataclass
class Node:
    """One ``aenv serve`` behind the gateway and what the gateway last learnt of it."""

    id: str
    url: str
    host: str
    port: int
    up: bool = False
    since: float = field(default_factory=time.time)  # when ``up`` last changed
    reason: str = "not probed yet"  # why it is down (empty while up)
    counts: dict[str, int] = field(default_factory=dict)  # sandboxes by state, from /aenv/info
    starting: int = 0
    runtime: str | None = None
    version: str | None = None
    reported_at: float | None = None  # when /aenv/info last answered
    inflight: int = 0  # creates the gateway is relaying to it right now
    placed: int = 0  # creates that succeeded since its last report (not in ``counts`` yet)
    fenced: str | None = None  # the cluster directory declared it dead (why): down whatever probes say
    incarnation: int = 0  # the directory's, in cluster mode
    machine: MachineKey | None = None  # vm: the machine its saved state restores on (None: ns, or unknown)
    warm: dict[str, int] = field(default_factory=dict)  # ready pool entries per template ID and alias
    teams: dict[str, dict[str, int]] = field(default_factory=dict)  # what each team holds there (quotas.py)
    placed_by_team: dict[str, int] = field(default_factory=dict)  # ``placed``, per team
    # what the directory reported lost with it (cluster mode): how many, and the latest IDs
    lost: deque[str] = field(default_factory=lambda: deque(maxlen=LOST_KEPT))
    lost_count: int = 0
    held: frozenset[str] = frozenset()  # the built templates it holds (IDs and names): no fetch from the store
    store: str | None = None  # the template store it shares with other nodes (None: none shared)

    def report(self, info: dict[str, Any]) -> None:
        """Take in the node's ``/aenv/info`` answer (one that carries its load)."""
        self.counts = {str(k): int(v) for k, v in info["sandboxes"].items()}
        self.starting = int(info.get("starting", 0))
        self.runtime = info.get("runtime")
        self.machine = parse(info.get("machine"))
        warm = info.get("warm")
        self.warm = {str(k): v for k, v in warm.items() if isinstance(v, int) and v > 0} if isinstance(warm, dict) else {}
        held = info.get("held")
        self.held = frozenset(str(t) for t in held) if isinstance(held, list) else frozenset()
        self.store = info["templateStore"] if isinstance(info.get("templateStore"), str) else None
        teams = info.get("teams")
        self.teams = {str(k): v for k, v in teams.items() if isinstance(v, dict)} if isinstance(teams, dict) else {}
        self.placed = 0  # the report now counts them
        self.placed_by_team = {}
        self.reported_at = time.time()

    def warm_for(self, template: str | None) -> bool:
        """It has a sandbox of ``template`` started ahead (its create is a hand-out, not a start)."""
        return template is not None and self.warm.get(template, 0) > 0

    def holds(self, template: str | None) -> bool:
        """It has the built template ``template`` already (a create there fetches nothing)."""
        return template is not None and (template in self.held or template.partition(":")[0] in self.held)

    @property
    def load(self) -> float:
        """What placement compares: live sandboxes (paused ones at a quarter: they hold memory, not CPU),
        plus creates the gateway sent since the node last reported."""
        running = self.counts.get("running", 0) + self.starting
        return running + 0.25 * self.counts.get("paused", 0) + self.inflight + self.placed

    def describe(self) -> dict[str, Any]:
        return {
            "nodeID": self.id,
            "url": self.url,
            "state": "up" if self.up else ("dead" if self.fenced else "down"),
            **({"incarnation": self.incarnation} if self.incarnation else {}),
            "since": self.since,
            **({} if self.up else {"reason": self.reason}),
            "runtime": self.runtime,
            "machine": self.machine,
            "warm": dict(self.warm),
            "templateStore": self.store,
            "version": self.version,
            "sandboxes": dict(self.counts),
            "starting": self.starting,
            "inflight": self.inflight,
            "load": self.load,
            "reportedAt": self.reported_at,
            **({"lost": {"count": self.lost_count, "sandboxes": list(self.lost)}} if self.lost_count else {}),
        }

    def record_lost(self, sandbox_id: str) -> None:
        """The directory marked one of its sandboxes lost (the node was declared dead)."""
        self.lost_count += 1
        self.lost.append(sandbox_id)


def parse_node(spec: str, index: int) -> Node:
    """``URL`` or ``NAME=URL`` (a name is ``n1``, ``n2``… by position otherwise). Raises ValueError."""
    name, sep, url = spec.partition("=")
    if not sep:
        name, url = f"n{index + 1}", spec
    url = url.rstrip("/")
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.path:
        raise ValueError(f"node '{spec}': give http://HOST:PORT (optionally NAME=http://HOST:PORT)")
    return Node(id=name, url=url, host=parts.hostname, port=parts.port or 80)


class NodeSet:
    """The nodes, their probes and the up/down bookkeeping."""

    def __init__(self, nodes: list[Node], client: httpx.AsyncClient, key: str | None, interval: float = 1.0) -> None:
        ids = [n.id for n in nodes]
        if len(set(ids)) != len(ids):
            raise ValueError(f"node names must be unique: {ids}")
        self.nodes = {n.id: n for n in nodes}
        self._client = client
        self._headers = {"X-API-KEY": key} if key else {}
        self._interval = interval
        self._task: asyncio.Task[None] | None = None
        self.probe_get: ProbeGet | None = None  # None: the httpx client's (tests, a gateway without a forwarder)

    def get(self, node_id: str) -> Node | None:
        return self.nodes.get(node_id)

    def up(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.up]

    def down(self) -> list[Node]:
        return [n for n in self.nodes.values() if not n.up]

    def mark_down(self, node: Node, reason: str) -> None:
        """The node refused or dropped a connection: no creates until a probe gets an answer again."""
        if node.up:
            log.warning("node=%s %s down: %s", node.id, node.url, reason)
            node.up, node.since = False, time.time()
        node.reason = node.fenced or reason

    def fence(self, node: Node, reason: str) -> None:
        """The cluster declared the node dead: down until it registers a new incarnation."""
        node.fenced = reason
        self.mark_down(node, reason)

    def _mark_up(self, node: Node) -> None:
        if node.fenced is None and not node.up:
            log.info("node=%s %s up", node.id, node.url)
            node.up, node.since, node.reason = True, time.time(), ""

    async def probe(self, node: Node) -> None:
        """Ask the node how it is: ``/aenv/info`` (load) when the gateway's key opens it, else ``/health``."""
        try:
            status, body = await self._get(node, "/aenv/info", self._headers)
            if status in (401, 403):  # no key for the load: liveness alone
                status, body = await self._get(node, "/health", {})
        except Exception as exc:  # noqa: BLE001 - httpx's errors, the forwarder's (NodeError), timeouts: down
            self.mark_down(node, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            return
        if status != 200:
            self.mark_down(node, f"health answered {status}")
            return
        info = json.loads(body)
        if "sandboxes" in info:
            node.report(info)
        node.version = info.get("version", node.version)
        self._mark_up(node)

    async def _get(self, node: Node, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
        if self.probe_get is not None:
            return await self.probe_get(node, path, headers, PROBE_TIMEOUT)
        r = await self._client.get(node.url + path, headers=headers, timeout=PROBE_TIMEOUT)
        return r.status_code, r.content

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(n) for n in list(self.nodes.values())))

    async def start(self) -> None:
        """Probe every node once (so the first create has loads to compare), then keep probing."""
        await self.probe_all()
        self._task = asyncio.create_task(self._loop(), name="gateway-node-probes")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.probe_all()
            except Exception:  # noqa: BLE001 - a probe bug must not end the probing
                log.exception("node probes failed")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

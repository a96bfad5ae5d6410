"""The gateway on a cluster directory (``aenv gateway --redis``): nodes and bindings come from Redis.

- membership: the node records (``aenv:node:*``) are read at start, on every ``node`` event and every
  probe interval; a node the directory declares dead is *fenced* in the ``NodeSet``: no creates, its
  sandboxes answer 404 naming it, and a probe that gets an answer does not bring it back — only a new
  incarnation (the node registered again) does;
- bindings: a lookup the cache misses reads ``aenv:sbx:<id>`` (the owning node wrote it before it
  answered the create); when Redis cannot be reached the gateway asks the live nodes, as without one;
- volumes: ``aenv:vol:<id>`` and, for a create's ``volumeMounts``, ``aenv:volname:<owner>:<name>`` (the
  owner is the sha256 of the API key, as a node computes it); a volume stays bound to a dead node;
- the cache follows the event stream: ``unbind``/``lost`` drop an entry, ``bind`` fills it (``vunbind``,
  ``vbind`` for volumes); after a
  lost connection to Redis the whole cache is dropped (events may have been missed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from redis.exceptions import RedisError

from aenv.directory.reader import DirectoryReader, NodeRecord
from aenv.gateway.directory import AskNodes, Locator
from aenv.gateway.nodes import NodeSet, parse_node

log = logging.getLogger("aenv.gateway")


class RedisDirectory:
    """``Directory`` over the cluster's Redis, with the nodes' own answers as the fallback."""

    def __init__(self, reader: DirectoryReader, fallback: AskNodes) -> None:
        self._reader = reader
        self._fallback = fallback

    async def find_sandbox(self, sandbox_id: str) -> str | None:
        try:
            binding = await self._reader.binding(sandbox_id)
        except (RedisError, OSError) as exc:
            log.warning("cluster directory unreachable for sandbox=%s (%s): asking the nodes", sandbox_id, exc)
            return await self._fallback.find_sandbox(sandbox_id)
        if binding is not None:
            return binding.node
        # No binding: an ended sandbox's is gone with it. The node whose tombstone names it answers the
        # client as it would without a gateway (when and why: killed, expired, lease_expired...).
        return await self._fallback.find_ended_sandbox(sandbox_id)

    async def find_snapshot(self, snapshot_id: str) -> str | None:
        return await self._fallback.find_snapshot(snapshot_id)  # snapshots are not in the directory yet

    async def published(self, sandbox_id: str) -> bool:
        try:
            binding = await self._reader.binding(sandbox_id)
        except (RedisError, OSError) as exc:
            log.warning("cluster directory unreachable for sandbox=%s (%s): not adopted elsewhere", sandbox_id, exc)
            return False
        return binding is not None and binding.state == "lost" and binding.published

    async def find_volume(self, volume_id: str, path: str, headers: dict[str, str]) -> str | None:
        try:
            return await self._reader.volume_node(volume_id)
        except (RedisError, OSError) as exc:
            log.warning("cluster directory unreachable for volume=%s (%s): asking the nodes", volume_id, exc)
            return await self._fallback.find_volume(volume_id, path, headers)

    async def find_volume_named(self, name: str, owner: str, headers: dict[str, str]) -> str | None:
        try:
            found = await self._reader.volume_named(owner, name)
        except (RedisError, OSError) as exc:
            log.warning("cluster directory unreachable for volume name %s (%s): asking the nodes", name, exc)
            return await self._fallback.find_volume_named(name, owner, headers)
        return found[1] if found else None


def apply_records(nodes: NodeSet, records: list[NodeRecord]) -> None:
    """Bring the node set in line with the directory: new nodes added, dead ones fenced, a new
    incarnation of a fenced one let back in (its next probe brings it up)."""
    for rec in records:
        node = nodes.get(rec.id)
        if node is None:
            try:
                node = parse_node(f"{rec.id}={rec.url}", 0)
            except ValueError as exc:
                log.warning("node=%s in the directory has a bad url: %s", rec.id, exc)
                continue
            nodes.nodes[rec.id] = node
            log.info("node=%s %s joined (incarnation %d)", rec.id, rec.url, rec.incarnation)
        elif node.url != rec.url.rstrip("/"):
            fresh = parse_node(f"{rec.id}={rec.url}", 0)
            node.url, node.host, node.port = fresh.url, fresh.host, fresh.port
        if rec.status == "dead":
            at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(rec.since))
            nodes.fence(node, f"declared dead by the cluster at {at}: {rec.reason or 'no reason given'}")
        elif node.fenced is not None and rec.incarnation != node.incarnation:
            node.fenced = None
            log.info("node=%s rejoined (incarnation %d)", rec.id, rec.incarnation)
        node.incarnation = rec.incarnation


class Follower:
    """Keeps the node set and the binding cache in line with the directory (a task per gateway)."""

    def __init__(self, reader: DirectoryReader, nodes: NodeSet, locator: Locator, interval: float) -> None:
        self._reader = reader
        self._nodes = nodes
        self._locator = locator
        self._interval = interval
        self._tasks: list[asyncio.Task[None]] = []

    async def refresh(self) -> None:
        try:
            apply_records(self._nodes, await self._reader.nodes())
        except (RedisError, OSError) as exc:
            log.warning("cluster directory unreachable (%s): the node list stays as it was", exc)

    async def _on_event(self, line: str) -> None:
        kind, _, rest = line.partition(" ")
        args = rest.split()
        if kind in ("unbind", "lost") and args:
            self._locator.forget(args[0])
            if kind == "lost" and len(args) == 2 and (node := self._nodes.get(args[1])) is not None:
                node.record_lost(args[0])
        elif kind == "bind" and len(args) == 2:
            self._locator.remember(args[0], args[1])
        elif kind == "vunbind" and args:
            self._locator.forget_volume(args[0])
        elif kind == "vbind" and len(args) == 2:
            self._locator.remember_volume(args[0], args[1])
        elif kind == "node":
            await self.refresh()

    async def _on_reconnect(self) -> None:
        self._locator.forget_all()
        await self.refresh()

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self.refresh()

    async def start(self) -> None:
        await self.refresh()
        self._tasks = [asyncio.create_task(self._reader.follow(self._on_event, self._on_reconnect), name="gw-events"),
                       asyncio.create_task(self._poll(), name="gw-directory-poll")]  # fmt: skip

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._reader.aclose()


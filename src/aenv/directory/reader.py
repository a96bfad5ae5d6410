"""A gateway's side of the cluster directory (asyncio): the node records, one sandbox's (or volume's)
binding, and the event stream the gateway's caches follow.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import redis.asyncio as aredis
from redis.exceptions import RedisError

from aenv.directory import keys

log = logging.getLogger("aenv.directory")


@dataclass(frozen=True)
class NodeRecord:
    id: str
    url: str
    incarnation: int
    status: str  # alive | dead
    since: float
    reason: str


@dataclass(frozen=True)
class Binding:
    node: str
    state: str  # live | lost
    reason: str
    published: bool = False  # paused with its state in the snapshot store: another node may adopt it once lost


class DirectoryReader:
    def __init__(self, url: str) -> None:
        self.client: aredis.Redis = aredis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0,
                                                          decode_responses=True)  # fmt: skip

    async def nodes(self) -> list[NodeRecord]:
        """Every node record, by id: two round trips whatever the count (the records' reads pipelined; each
        gateway reads them every probe interval and on every ``node`` event)."""
        ids = sorted(str(i) for i in await self.client.smembers(keys.NODES))
        async with self.client.pipeline(transaction=False) as pipe:
            for node_id in ids:
                pipe.hgetall(keys.node_key(node_id))
            replies = await pipe.execute() if ids else []
        out = []
        for node_id, reply in zip(ids, replies, strict=True):
            rec = keys.strs(reply)
            if rec.get("url"):
                out.append(NodeRecord(node_id, rec["url"], int(rec.get("incarnation", 0)), rec.get("status", "alive"),
                                      float(rec.get("since", 0)), rec.get("reason", "")))  # fmt: skip
        return out

    async def binding(self, sandbox_id: str) -> Binding | None:
        rec = keys.strs(await self.client.hgetall(keys.sandbox_key(sandbox_id)))
        if not rec.get("node"):
            return None
        return Binding(rec["node"], rec.get("state", "live"), rec.get("reason", ""), bool(rec.get("paused")))

    async def volume_node(self, volume_id: str) -> str | None:
        """The node a volume is bound to (whatever that node's state), or None."""
        node = await self.client.hget(keys.volume_key(volume_id), "node")
        return str(node) if node else None

    async def volume_named(self, owner: str, name: str) -> tuple[str, str] | None:
        """``(volume id, node)`` of the volume of ``owner`` that holds ``name``, or None."""
        vid = await self.client.get(keys.volume_name_key(owner, name))
        node = await self.volume_node(str(vid)) if vid else None
        return (str(vid), node) if node else None

    async def follow(self, on_event: Callable[[str], Awaitable[None]], on_reconnect: Callable[[], Awaitable[None]]) -> None:
        """Call ``on_event`` with each event line until cancelled; after a lost connection (events may
        have been missed), ``on_reconnect`` first, so the caller drops what it cached."""
        while True:
            try:
                async with self.client.pubsub() as ps:
                    await ps.subscribe(keys.EVENTS)
                    await on_reconnect()
                    async for msg in ps.listen():
                        if msg.get("type") == "message":
                            await on_event(str(msg["data"]))
            except (RedisError, OSError) as exc:
                log.warning("cluster directory events: %s; reconnecting", exc)
                await asyncio.sleep(1.0)

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self.client.aclose()

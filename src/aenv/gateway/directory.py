"""Which node owns a sandbox (or a snapshot, or a volume): an in-memory cache in front of a ``Directory``.

The cache is filled from the answers the gateway relays (create, fork, snapshot) and, on a miss, from
the directory. ``AskNodes`` (a static node list) has no state of its own: it asks every live node for the
ID and takes the one that knows it. ``cluster.RedisDirectory`` reads the bindings the owning nodes wrote
themselves, and its follower keeps this cache in line with the directory's events.

Volumes are scoped to the API key that made them (and their content API to each volume's token), so
``AskNodes`` asks the nodes about a volume with the client's own credentials.

Errors (``OwnerUnknown``, ``OwnerDown``) are the gateway's own: the sandbox is on no live node, or on
one that is down. Both reach clients as 404s (control plane) or E2B's 502 (proxy) naming the node.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections import OrderedDict
from typing import Protocol

import httpx

from aenv.file_urls import file_signature
from aenv.gateway.nodes import Node, NodeSet

MAX_CACHED = 1_000_000  # bindings kept in memory (least recently used dropped first)


class GatewayError(Exception):
    """The gateway could not say where a sandbox is."""

    reason: str | None = "unknown"

    def __init__(self, message: str, node: Node | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.node = node


class OwnerUnknown(GatewayError):
    """No live node knows the ID (some nodes may be down: the message names them). Answered in a node's
    own words for an unknown ID, with no reason: a node's 404 for another team's ID is relayed as the
    same answer (``forward.Relayed``), so the gateway tells no one whether some team has the ID."""

    reason = None


class OwnerDown(GatewayError):
    """The ID is bound to a node that is down."""

    reason = "node_down"


class Directory(Protocol):
    """Where bindings come from when the cache has none."""

    async def find_sandbox(self, sandbox_id: str) -> str | None: ...
    async def find_snapshot(self, snapshot_id: str) -> str | None: ...
    async def published(self, sandbox_id: str) -> bool: ...
    # ``path``: what a node answers 200 to when it holds the volume, asked with the client's ``headers``
    async def find_volume(self, volume_id: str, path: str, headers: dict[str, str]) -> str | None: ...
    # the node of the volume ``api_key``'s owner named ``name``
    async def find_volume_named(self, name: str, owner: str, headers: dict[str, str]) -> str | None: ...


class AskNodes:
    """The static directory: ask every live node at once; the one that answers 200 owns the ID. Failing
    that, one whose 404 says the sandbox ended there (a tombstone: ``endedAt``) is bound, so that it
    tells the client when and why, as it would without a gateway."""

    def __init__(self, nodes: NodeSet, client: httpx.AsyncClient, key: str | None) -> None:
        self._nodes = nodes
        self._client = client
        self._headers = {"X-API-KEY": key} if key else {}

    async def _ask(self, path: str, headers: dict[str, str] | None = None, ended_only: bool = False) -> str | None:
        async def one(node: Node) -> tuple[int, str] | None:
            try:
                r = await self._client.get(node.url + path, headers=headers or self._headers, timeout=5.0)
            except httpx.TransportError as exc:
                self._nodes.mark_down(node, f"{type(exc).__name__}: {exc}")
                return None
            if r.status_code == 200 and not ended_only:
                return 0, node.id
            if r.status_code in (404, 410) and b'"endedAt"' in r.content:
                return 1, node.id
            return None

        found = [f for f in await asyncio.gather(*(one(n) for n in self._nodes.up())) if f is not None]
        return min(found)[1] if found else None

    async def find_sandbox(self, sandbox_id: str) -> str | None:
        return await self._ask(f"/sandboxes/{sandbox_id}")

    async def find_ended_sandbox(self, sandbox_id: str) -> str | None:
        """The live node whose tombstone says the sandbox ended there (a sandbox it runs does not count)."""
        return await self._ask(f"/sandboxes/{sandbox_id}", ended_only=True)

    async def find_snapshot(self, snapshot_id: str) -> str | None:
        return await self._ask(f"/snapshots/{snapshot_id}")

    async def published(self, sandbox_id: str) -> bool:
        return False  # published pauses live in the cluster directory only

    async def find_volume(self, volume_id: str, path: str, headers: dict[str, str]) -> str | None:
        return await self._ask(path, headers)

    async def find_volume_named(self, name: str, owner: str, headers: dict[str, str]) -> str | None:
        async def one(node: Node) -> str | None:
            try:
                r = await self._client.get(node.url + "/volumes", headers=headers, timeout=5.0)
            except httpx.TransportError as exc:
                self._nodes.mark_down(node, f"{type(exc).__name__}: {exc}")
                return None
            listed = r.json() if r.status_code == 200 else []
            return node.id if any(isinstance(v, dict) and v.get("name") == name for v in listed) else None

        found = [f for f in await asyncio.gather(*(one(n) for n in self._nodes.up())) if f is not None]
        return found[0] if found else None


class Locator:
    """The binding cache and the answers built on it."""

    def __init__(self, nodes: NodeSet, directory: Directory, max_cached: int = MAX_CACHED) -> None:
        self.nodes = nodes
        self._directory = directory
        self._sandboxes: OrderedDict[str, str] = OrderedDict()
        self._snapshots: OrderedDict[str, str] = OrderedDict()
        self._tokens: OrderedDict[str, str] = OrderedDict()  # envd access tokens the relayed answers carried
        self._volumes: OrderedDict[str, str] = OrderedDict()
        self._max = max_cached

    def remember(self, sandbox_id: str, node_id: str) -> None:
        _put(self._sandboxes, sandbox_id, node_id, self._max)

    def forget(self, sandbox_id: str) -> None:
        self._sandboxes.pop(sandbox_id, None)

    def forget_all(self) -> None:
        self._sandboxes.clear()
        self._volumes.clear()

    def remember_volume(self, volume_id: str, node_id: str) -> None:
        _put(self._volumes, volume_id, node_id, self._max)

    def forget_volume(self, volume_id: str) -> None:
        self._volumes.pop(volume_id, None)

    async def volume_owner(self, volume_id: str, path: str, headers: dict[str, str]) -> Node:
        """The live node that holds ``volume_id`` (``path``/``headers``: see ``Directory.find_volume``).
        Raises OwnerDown or OwnerUnknown."""
        node_id = self._volumes.get(volume_id) or await self._directory.find_volume(volume_id, path, headers)
        return self._bound(self._volumes, "volume", volume_id, node_id)

    async def volume_home(self, name: str, owner: str, headers: dict[str, str]) -> Node | None:
        """The node that holds the volume named ``name`` (of team ``owner``), up or down; None when
        no node is known to."""
        node_id = await self._directory.find_volume_named(name, owner, headers)
        return self.nodes.get(node_id) if node_id is not None else None

    def remember_token(self, sandbox_id: str, token: str) -> None:
        _put(self._tokens, sandbox_id, token, self._max)

    def find_by_file_signature(
        self, path: str, op: str, user: str, signature: str, expiration: str | None
    ) -> str | None:
        """The sandbox whose access token signed a file URL that names no sandbox (``download_url()`` with
        ``E2B_SANDBOX_URL`` set), among those whose create, connect or fork answer the gateway relayed."""
        for sandbox_id, token in self._tokens.items():
            if hmac.compare_digest(file_signature(path, op, user, token, expiration), signature):
                return sandbox_id
        return None

    def remember_snapshot(self, snapshot_id: str, node_id: str) -> None:
        _put(self._snapshots, snapshot_id, node_id, self._max)

    def cached(self, sandbox_id: str) -> Node | None:
        node_id = self._sandboxes.get(sandbox_id)
        return self.nodes.get(node_id) if node_id is not None else None

    def snapshot_home(self, snapshot_id: str) -> Node | None:
        """The node a snapshot was taken on, if the gateway relayed it (no lookup: a hint for placement)."""
        node_id = self._snapshots.get(snapshot_id)
        return self.nodes.get(node_id) if node_id is not None else None

    async def owner(self, sandbox_id: str) -> Node:
        """The live node that owns ``sandbox_id``. Raises OwnerDown or OwnerUnknown."""
        node = self.cached(sandbox_id)
        if node is None:
            node_id = await self._directory.find_sandbox(sandbox_id)
            if node_id is not None:
                self.remember(sandbox_id, node_id)
                node = self.nodes.get(node_id)
        if node is None:
            raise OwnerUnknown(f"sandbox '{sandbox_id}' not found{self._down_note()}")
        if not node.up:
            raise OwnerDown(down_message(f"sandbox '{sandbox_id}'", node), node)
        return node

    async def published(self, sandbox_id: str) -> bool:
        """The sandbox was lost with its node and its pause is published: another node may adopt it."""
        return await self._directory.published(sandbox_id)

    async def snapshot_owner(self, snapshot_id: str) -> Node:
        node_id = self._snapshots.get(snapshot_id) or await self._directory.find_snapshot(snapshot_id)
        return self._bound(self._snapshots, "snapshot", snapshot_id, node_id)

    def _bound(self, cache: OrderedDict[str, str], what: str, key: str, node_id: str | None) -> Node:
        """The node ``key`` is bound to, remembered in ``cache``. Raises OwnerDown or OwnerUnknown."""
        node = self.nodes.get(node_id) if node_id is not None else None
        if node is None:
            raise OwnerUnknown(f"{what} '{key}' not found{self._down_note()}")
        _put(cache, key, node.id, self._max)
        if not node.up:
            raise OwnerDown(down_message(f"{what} '{key}'", node), node)
        return node

    def _down_note(self) -> str:
        down = self.nodes.down()
        if not down:
            return ""
        return " on any live node (down, so not asked: " + ", ".join(f"node {n.id} {n.url}" for n in down) + ")"


def down_message(what: str, node: Node) -> str:
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(node.since))
    return f"{what} is on node {node.id} ({node.url}), which is down since {at}: {node.reason}"


def _put(cache: OrderedDict[str, str], key: str, value: str, limit: int) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > limit:
        cache.popitem(last=False)

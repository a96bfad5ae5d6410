"""Sandbox traffic through the gateway: the node's own ``SandboxProxy``, with TCP to the owning node where
the node has a mux stream into the sandbox.

Requests are recognised exactly as a node recognises them (``route``: the ``E2b-Sandbox-Id`` header or a
``<port>-<id>.`` Host) and relayed byte for byte by the same HTTP/1.1 relay and WebSocket relay, headers
and Host unchanged, so the node routes them again and applies the sandbox's own rules (traffic tokens,
masked Host, envd's internal routes): the gateway adds one hop, not a second set of rules. Kept-alive
connections are pooled per node, shared by its sandboxes.
"""

from __future__ import annotations

import asyncio
import logging

from aenv.api.proxy import SandboxProxy
from aenv.api.proxy.codec import ASGIApp, Receive, Scope, Send
from aenv.api.proxy.connect_end import CLIENT_H2_HEADER
from aenv.api.proxy.pool import UpstreamPool
from aenv.api.proxy.routing import HopDown, json_error, respond, route, route_signed_files_url, sandbox_error
from aenv.api.proxy.websocket import deny
from aenv.gateway.directory import GatewayError, Locator
from aenv.gateway.fast_routes import FastRoutes
from aenv.gateway.forward import CONNECT_TIMEOUT, Forwarder
from aenv.gateway.nodes import NodeSet
from aenv.gateway.volumes import relay_content
from aenv.mux import ByteStream
from aenv.mux.direct import open_tcp

log = logging.getLogger("aenv.gateway")


class _ToNode:
    """The pool's opener: a TCP connection to the node that owns the sandbox (located just before)."""

    def __init__(self, locator: Locator, nodes: NodeSet) -> None:
        self._locator = locator
        self._nodes = nodes

    async def open_stream(self, sandbox_id: str, port: int) -> ByteStream:
        node = self._locator.cached(sandbox_id)
        if node is None:  # located moments ago; forgotten only under a million others
            node = await self._locator.owner(sandbox_id)
        try:  # a node that takes no connection is down, as for the control plane (forward.py)
            return await asyncio.wait_for(open_tcp(node.host, node.port, port), CONNECT_TIMEOUT)
        except OSError as exc:  # TimeoutError included
            why = f"{type(exc).__name__}: {str(exc) or f'no answer in {CONNECT_TIMEOUT:g} s'}"
            self._nodes.mark_down(node, why)
            raise HopDown(f"its node {node.id} ({node.url}) took no connection: {why}", node.id) from exc


class _NodePool(UpstreamPool):
    """Kept-alive connections per node, shared by all its sandboxes (each request names its own sandbox),
    so a gateway holds as many as requests run at once, not one set per sandbox."""

    max_idle = 256

    def __init__(self, opener: _ToNode, locator: Locator) -> None:
        super().__init__(lambda: opener)
        self._locator = locator

    def _key(self, sandbox_id: str) -> tuple[str, int]:
        node = self._locator.cached(sandbox_id)
        return (f"node:{node.id}", 0) if node is not None else (sandbox_id, 0)

    async def acquire(self, sandbox_id: str, port: int) -> tuple[ByteStream, bool]:
        stream = await self._take_idle(self._key(sandbox_id))
        if stream is not None:
            return stream, True
        return await self.open(sandbox_id, port), False

    async def release(self, sandbox_id: str, port: int, stream: ByteStream) -> None:
        await super().release(*self._key(sandbox_id), stream)

    def prewarm(self, sandbox_id: str, port: int) -> None:
        """A new sandbox's first request finds a connection to its node when one is idle: opening one
        more per create (as a node does per sandbox) would only load gateway and node at that moment."""
        key = self._key(sandbox_id)
        if self._idle.get(key):
            return
        super().prewarm(sandbox_id, port)


class GatewayProxy(SandboxProxy):
    """ASGI middleware in front of the gateway's control plane."""

    def __init__(self, app: ASGIApp, locator: Locator, nodes: NodeSet, ws_max_message: int,
                 forwarder: Forwarder | None = None, fast: FastRoutes | None = None) -> None:  # fmt: skip
        opener = _ToNode(locator, nodes)
        # The base class asks its getter only for open_stream once __call__ and _ingress are replaced.
        super().__init__(app, lambda: opener, ws_max_message)  # type: ignore[arg-type,return-value]
        self.pool = _NodePool(opener, locator)
        self._locator = locator
        self._forwarder = forwarder  # for the volume content API, streamed to the volume's node
        self._fast = fast  # creates, past FastAPI's routing

    def prewarm(self, sandbox_id: str) -> None:  # the node prewarms its own stream into the sandbox
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        target = route(scope) if kind in ("http", "websocket") else None
        if target is None and kind == "http":
            target = route_signed_files_url(scope, lambda: self._locator)
        if target is None:
            if self._fast is not None and (handler := self._fast.find(scope)) is not None:
                await self._fast.serve(handler, scope, receive, send)
                return
            if kind == "http" and self._forwarder is not None and scope["path"].startswith("/volumecontent/"):
                await relay_content(self._locator, self._forwarder, scope, receive, send)
                return
            if kind == "http" and scope["path"] == "/files":
                message = ("invalid or missing file URL signature (through the gateway, a URL that names no sandbox "
                           "is known only for sandboxes whose create or connect went through this gateway)")
                await respond(send, *json_error(401, {"code": 401, "message": message}))
                return
            await self.app(scope, receive, send)
            return
        sandbox_id, port = target
        try:
            await self._locator.owner(sandbox_id)
        except GatewayError as exc:
            extra = {"reason": exc.reason or "not_found", "detail": exc.message,
                     **({"node": exc.node.id} if exc.node else {})}  # fmt: skip
            refused = sandbox_error(sandbox_id, "The sandbox was not found", **extra)  # E2B's words exactly
            if kind == "http":
                await respond(send, *refused)
            else:
                await receive()  # websocket.connect
                await deny(scope, send, *refused)
            return
        if kind == "http":
            await self._proxy_http(scope, receive, send, sandbox_id, port)
        else:
            await self._proxy_websocket(scope, receive, send, sandbox_id, port)

    def _client_h2(self, scope: Scope) -> tuple[Scope, bool]:
        """The node is told the client speaks HTTP/2: it then cuts a broken stream, which this side resets."""
        if scope.get("http_version") != "2":
            return scope, False
        return {**scope, "headers": [*scope["headers"], (CLIENT_H2_HEADER, b"1")]}, True

    def _ingress(self, scope: Scope, sandbox_id: str, port: int) -> tuple[Scope, tuple[int, bytes] | None]:
        """Nothing to check here: the node applies the sandbox's inbound rules to what it is relayed."""
        return scope, None

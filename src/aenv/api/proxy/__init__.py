"""The sandbox proxy: HTTP requests carrying ``E2b-Sandbox-Id`` (or a ``<port>-<id>.`` Host) go into the
sandbox, everything else falls through to the control plane (spec §1.5).

A byte-level HTTP/1.1 relay over mux streams, in four parts: ``routing`` picks the sandbox and port,
``codec`` reads and writes HTTP/1.1, ``pool`` keeps upstream streams alive between requests and ``relay``
runs one exchange. ``SandboxProxy``, the ASGI middleware, ties them together: the request head goes out
with the first piece of the body in one frame, a kept-alive stream that died while idle is replaced when
the request can still be resent, and any upstream failure becomes E2B's 502.

WebSocket upgrades (the ASGI ``websocket`` scope) are relayed message by message over a stream of their
own (``websocket``, ``wsframe``). Other upgrades are 501s: uvicorn gives the app no raw connection to
switch; an ``h2c`` upgrade, which a client makes only in passing, is ignored as RFC 9110 allows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from aenv.api.console.sessions import without_session_cookie
from aenv.core.network import ingress_of
from aenv.core.orchestrator import Orchestrator
from aenv.errors import NotFound, PortNotOpen
from aenv.mux import ByteStream, MuxError, StreamRefused

from .codec import (
    MAX_HEAD,
    ASGIApp,
    ChunkedDecoder,
    Receive,
    Scope,
    Send,
    UpstreamError,
    frame_unsized_body,
    parse_response_head,
    request_head,
)
from .connect_end import client_speaks_h2
from .pool import IDLE_EXPIRY, MAX_IDLE_PER_TARGET, UpstreamPool
from .relay import _Exchange, _NoResponse, _pump_and_watch, _relay_response, start_request
from .routing import (
    ENVD_PORT,
    ingress,
    refusal,
    respond,
    route,
    route_signed_files_url,
    unsigned_files_url,
    upgrade_tokens,
    upstream_error,
)
from .websocket import deny, proxy_websocket, upgrade_refusal

# Largest WebSocket message relayed either way unless the app says otherwise (uvicorn's own default).
WS_MAX_MESSAGE = 16 * 1024 * 1024

__all__ = [
    "ENVD_PORT",
    "IDLE_EXPIRY",
    "MAX_HEAD",
    "MAX_IDLE_PER_TARGET",
    "ChunkedDecoder",
    "SandboxProxy",
    "UpstreamError",
    "UpstreamPool",
    "WS_MAX_MESSAGE",
    "parse_response_head",
    "request_head",
    "route",
]

log = logging.getLogger("aenv.proxy")


class SandboxProxy:
    """ASGI middleware in front of the control-plane app."""

    def __init__(
        self, app: ASGIApp, get_orchestrator: Callable[[], Orchestrator], ws_max_message: int = WS_MAX_MESSAGE
    ) -> None:
        self.app = app
        self._get = get_orchestrator
        self.pool = UpstreamPool(get_orchestrator)
        self.ws_max_message = ws_max_message
        self.upgraded: set[ByteStream] = set()  # streams of relayed WebSocket connections, while they last

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self.pool.aclose()
        for stream in list(self.upgraded):
            await stream.aclose()

    def prewarm(self, sandbox_id: str) -> None:
        """Orchestrator.on_running hook: open an envd stream for a sandbox that just became usable, so
        the client's first request (typically right after create) skips the stream-opening round trip."""
        self.pool.prewarm(sandbox_id, ENVD_PORT)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            target = route(scope) or route_signed_files_url(scope, self._get)
            if target is not None:
                await self._proxy_http(without_session_cookie(scope), receive, send, *target)
                return
            if scope["path"] == "/files":
                # No routing header and no sandbox signed this URL: envd's answer for a bad signature.
                await respond(send, *unsigned_files_url())
                return
        elif scope["type"] == "websocket":
            target = route(scope)
            if target is not None:
                await self._proxy_websocket(without_session_cookie(scope), receive, send, *target)
                return
        await self.app(scope, receive, send)

    def _ingress(self, scope: Scope, sandbox_id: str, port: int) -> tuple[Scope, tuple[int, bytes] | None]:
        """The scope to forward and any refusal: ``refusal``, then the sandbox's inbound settings."""
        refused = refusal(scope, port)
        sbx = self._get().table.find(sandbox_id) if refused is None and port != ENVD_PORT else None
        if sbx is None or (sbx.row.traffic_token is None and not sbx.row.network):
            return scope, refused
        return ingress(scope, sandbox_id, port, ingress_of(sbx.row))

    async def _proxy_websocket(self, scope: Scope, receive: Receive, send: Send, sandbox_id: str, port: int) -> None:
        scope, refused = self._ingress(scope, sandbox_id, port)
        if refused is not None:
            await receive()  # websocket.connect
            await deny(scope, send, *refused)
            return

        async def open_stream() -> ByteStream:
            return await self.pool.open(sandbox_id, port)

        await proxy_websocket(scope, receive, send, sandbox_id, open_stream, self.upgraded, self.ws_max_message)

    def _client_h2(self, scope: Scope) -> tuple[Scope, bool]:
        """Whether the client speaks HTTP/2 (a broken stream is then reset), and the scope to relay."""
        return client_speaks_h2(scope)

    async def _proxy_http(self, scope: Scope, receive: Receive, send: Send, sandbox_id: str, port: int) -> None:
        scope, refused = self._ingress(scope, sandbox_id, port)
        if refused is not None:
            await respond(send, *refused)
            return
        tokens = upgrade_tokens(scope)
        if tokens and tokens != [b"h2c"]:
            await respond(send, *upgrade_refusal(tokens), close=True)
            return
        scope, _ = self._client_h2(scope)  # (a gateway's header is not the sandbox's to see)
        started = await start_request(scope, receive)
        if started is None:
            return
        head, framing, more_body = started
        if framing is None and scope.get("http_version") == "2":
            # An h2 request may carry a body with no Content-Length (its DATA frames frame it): its first
            # piece says which HTTP/1.1 framing it gets upstream (e.g. the SDK's Connect calls).
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            more_body = bool(msg.get("more_body", False))
            head, framing = frame_unsized_body(head, msg.get("body", b""), more_body)
        ex: _Exchange | None = None
        helper: asyncio.Task[None] | None = None
        try:
            stream, reused = await self.pool.acquire(sandbox_id, port)
            ex = _Exchange(stream, body_sent=not more_body)
            try:
                await stream.write(head)
                # Started only now: its body writes must follow the head on the stream.
                helper = asyncio.create_task(_pump_and_watch(receive, framing == "chunked", more_body, ex))
                await _relay_response(scope["method"], send, stream, ex)
            except (MuxError, _NoResponse):
                # A kept-alive stream that died while idle. The whole request is still in hand unless
                # its body streams on: a fresh stream takes it.
                if not reused or more_body or ex.started or ex.gone:
                    raise
                if helper is not None:
                    helper.cancel()
                    helper = None
                await stream.aclose()
                ex.stream = stream = await self.pool.open(sandbox_id, port)
                await stream.write(head)
                helper = asyncio.create_task(_pump_and_watch(receive, False, False, ex))
                await _relay_response(scope["method"], send, stream, ex)
        except Exception as exc:  # noqa: BLE001 - any upstream failure becomes a 502, never a crash
            if ex is not None:
                ex.finished = True
            if ex is not None and (ex.gone or ex.started):
                # The client left (envd keeps the process), or the sandbox broke off mid-response:
                # returning without completing it makes the server drop the client connection.
                if not ex.gone:
                    # Cut, on either protocol (connect_end.py): over HTTP/1.1 the chunked body stops short,
                    # over HTTP/2 the stream is reset (cli/tls_serve.py). Every SDK version probes the
                    # sandbox's /health on that transport failure and then says it was killed.
                    log.info("sandbox=%s proxy port=%s failed mid-response: %r", sandbox_id, port, exc)
            else:
                if not isinstance(exc, (NotFound, StreamRefused, PortNotOpen)):
                    log.info("sandbox=%s proxy port=%s failed: %r", sandbox_id, port, exc)
                await respond(send, *upstream_error(sandbox_id, exc))
        finally:
            if helper is not None:
                helper.cancel()
            if ex is not None:
                ex.finished = True
                if ex.reusable and not ex.gone:
                    await self.pool.release(sandbox_id, port, ex.stream)
                else:
                    await ex.stream.aclose()

"""The sandbox proxy: HTTP requests carrying ``E2b-Sandbox-Id`` (or a ``<port>-<id>.`` Host) go into the
sandbox, everything else falls through to the control plane (spec §1.5).

Requests are re-sent as HTTP/1.1 by httpcore over a mux stream (one per upstream connection, pooled
per sandbox with keep-alive). Bodies stream in both directions without buffering. When the client goes
away, the upstream connection is closed: envd then stops streaming but keeps the process running.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

import httpcore

from aenv.core.errors import NotFound, PortNotOpen, SandboxNotFound
from aenv.core.orchestrator import Orchestrator
from aenv.mux import MuxError, MuxStream, StreamRefused

log = logging.getLogger("aenv.proxy")

ENVD_PORT = 49983
_HOST_RE = re.compile(r"^(\d{1,5})-([a-z0-9][a-z0-9_-]{0,63})\.")
_DROP_REQUEST = {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"upgrade", b"proxy-authorization"}
_DROP_RESPONSE = {b"connection", b"keep-alive", b"transfer-encoding", b"trailer", b"upgrade", b"proxy-authenticate"}
# envd's internal routes: only the orchestrator may call them, never a client through the proxy.
_ENVD_INTERNAL = {"/init"}

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class _ClientGone(Exception):
    pass


def route(scope: Scope) -> tuple[str, int] | None:
    """(sandbox id, port) if this request is sandbox traffic, else None."""
    sandbox_id = port = host = None
    for name, value in scope.get("headers", ()):
        if name == b"e2b-sandbox-id":
            sandbox_id = value.decode("latin-1").strip()
        elif name == b"e2b-sandbox-port":
            port = value.decode("latin-1").strip()
        elif name == b"host":
            host = value.decode("latin-1")
    if sandbox_id:
        try:
            p = int(port) if port else ENVD_PORT
        except ValueError:
            p = -1
        return sandbox_id, p
    if host:
        m = _HOST_RE.match(host)
        if m:
            return m.group(2), int(m.group(1))
    return None


class MuxNetworkStream(httpcore.AsyncNetworkStream):
    """httpcore's view of a mux stream."""

    def __init__(self, stream: MuxStream) -> None:
        self._stream = stream

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            if timeout is None:
                return await self._stream.read(max_bytes)
            async with asyncio.timeout(timeout):
                return await self._stream.read(max_bytes)
        except TimeoutError:
            raise httpcore.ReadTimeout("sandbox read timed out") from None

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        try:
            await self._stream.write(buffer)
        except MuxError as exc:
            raise httpcore.WriteError(str(exc)) from exc

    async def aclose(self) -> None:
        await self._stream.aclose()

    def get_extra_info(self, info: str) -> Any:
        # httpcore asks this of idle keep-alive connections before reusing them: a stream whose mux
        # session ended (sandbox rolled back or restarted under the same ID) must not be reused.
        if info == "is_readable":
            return self._stream.closed or self._stream.at_eof
        return None


class SandboxBackend(httpcore.AsyncNetworkBackend):
    """httpcore network backend whose "host" is a sandbox ID and whose connections are mux streams."""

    def __init__(self, get_orchestrator: Callable[[], Orchestrator]) -> None:
        self._get = get_orchestrator

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._get().open_stream(host, port)
        return MuxNetworkStream(stream)

    async def connect_unix_socket(self, path: str, timeout: float | None = None, socket_options: Any = None) -> Any:
        raise httpcore.ConnectError("unix sockets are not used by the sandbox proxy")

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def _json_error(status: int, body: dict[str, Any]) -> tuple[int, bytes]:
    return status, json.dumps(body).encode()


class SandboxProxy:
    """ASGI middleware in front of the control-plane app."""

    def __init__(self, app: ASGIApp, get_orchestrator: Callable[[], Orchestrator]) -> None:
        self.app = app
        self._get = get_orchestrator
        self._pool: httpcore.AsyncConnectionPool | None = None

    @property
    def pool(self) -> httpcore.AsyncConnectionPool:
        if self._pool is None:
            self._pool = httpcore.AsyncConnectionPool(
                network_backend=SandboxBackend(self._get),
                max_connections=100_000,
                max_keepalive_connections=2_000,
                keepalive_expiry=60.0,
                retries=0,
            )
        return self._pool

    async def aclose(self) -> None:
        if self._pool is not None:
            with contextlib.suppress(Exception):
                await self._pool.aclose()
            self._pool = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            target = route(scope) or self._route_signed_files_url(scope)
            if target is not None:
                await self._proxy_http(scope, receive, send, *target)
                return
            if scope["path"] == "/files":
                # No routing header and no sandbox signed this URL: envd's answer for a bad signature.
                await self._respond(send, *_json_error(401, {"code": 401, "message": "invalid or missing file URL signature"}))
                return
        await self.app(scope, receive, send)

    def _route_signed_files_url(self, scope: Scope) -> tuple[str, int] | None:
        """``download_url()``/``upload_url()`` carry no sandbox ID when E2B_SANDBOX_URL is set: find the
        sandbox whose access token produced the URL's signature (spec §1.5 workaround)."""
        if scope["path"] != "/files" or scope["method"] not in ("GET", "POST"):
            return None
        params = parse_qs((scope.get("query_string") or b"").decode("latin-1"))
        signature = (params.get("signature") or [""])[0]
        path = (params.get("path") or [""])[0]
        if not signature.startswith("v1_") or not path:
            return None
        user = (params.get("username") or [""])[0]
        expiration = (params.get("signature_expiration") or [None])[0]
        op = "read" if scope["method"] == "GET" else "write"
        sandbox_id = self._get().find_by_file_signature(path, op, user, signature, expiration)
        return (sandbox_id, ENVD_PORT) if sandbox_id else None

    async def _respond(self, send: Send, status: int, body: bytes) -> None:
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _proxy_http(self, scope: Scope, receive: Receive, send: Send, sandbox_id: str, port: int) -> None:
        if not 0 < port < 65536:
            await self._respond(send, *_json_error(400, {"code": 400, "message": f"invalid E2b-Sandbox-Port '{port}'"}))
            return
        path = scope.get("raw_path") or scope["path"].encode()
        if port == ENVD_PORT and scope["path"] in _ENVD_INTERNAL:
            await self._respond(send, *_json_error(403, {"code": 403, "message": "internal envd route"}))
            return
        query = scope.get("query_string") or b""
        target = path + (b"?" + query if query else b"")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _DROP_REQUEST]
        has_body = any(
            (k == b"content-length" and v.strip() not in (b"", b"0")) or k == b"transfer-encoding" for k, v in headers
        )
        body_done = asyncio.Event()

        async def request_body() -> AsyncIterator[bytes]:
            try:
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        raise _ClientGone()
                    chunk = msg.get("body", b"")
                    if chunk:
                        yield chunk
                    if not msg.get("more_body", False):
                        return
            finally:
                body_done.set()

        if not has_body:
            # Drain the (empty) request so the disconnect watcher sees only http.disconnect.
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body_done.set()
        request = httpcore.Request(
            method=scope["method"].encode(),
            url=httpcore.URL(scheme=b"http", host=sandbox_id.encode(), port=port, target=target),
            headers=headers,
            content=request_body() if has_body else None,
            extensions={"timeout": {"connect": 30.0, "read": None, "write": None, "pool": 30.0}},
        )
        started = False

        async def forward() -> None:
            nonlocal started
            response = await self.pool.handle_async_request(request)
            try:
                out_headers = [(k, v) for k, v in response.headers if k.lower() not in _DROP_RESPONSE]
                await send({"type": "http.response.start", "status": response.status, "headers": out_headers})
                started = True
                async for chunk in response.stream:  # type: ignore[union-attr]
                    if chunk:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                await response.aclose()

        async def watch_disconnect() -> None:
            await body_done.wait()
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return

        forward_task = asyncio.create_task(forward())
        watch_task = asyncio.create_task(watch_disconnect())
        try:
            done, _ = await asyncio.wait({forward_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
            if forward_task in done:
                forward_task.result()
            else:
                # The client left: drop the upstream connection; envd keeps the process.
                forward_task.cancel()
                with contextlib.suppress(BaseException):
                    await forward_task
        except _ClientGone:
            pass
        except (SandboxNotFound, NotFound):
            if not started:
                await self._respond(
                    send,
                    *_json_error(502, {"sandboxId": sandbox_id, "message": "The sandbox was not found", "code": 502}),
                )
        except (StreamRefused, PortNotOpen):
            if not started:
                await self._respond(
                    send,
                    *_json_error(
                        502,
                        {"sandboxId": sandbox_id, "message": "The sandbox is running but port is not open", "code": 502},
                    ),
                )
        except Exception as exc:  # noqa: BLE001 - any upstream failure becomes a 502, never a crash
            log.info("sandbox=%s proxy port=%s failed: %r", sandbox_id, port, exc)
            if not started:
                await self._respond(
                    send,
                    *_json_error(
                        502,
                        {"sandboxId": sandbox_id, "message": f"The sandbox is unreachable: {type(exc).__name__}", "code": 502},
                    ),
                )
        finally:
            watch_task.cancel()
            with contextlib.suppress(BaseException):
                await watch_task

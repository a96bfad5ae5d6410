"""A tiny asyncio HTTP/1.1 server: just what the code-interpreter routes need, on the stdlib alone.

Why not uvicorn: the service runs under the template's Debian ``python3`` where only the layer's packages
exist, and four JSON routes plus one chunked stream do not justify shipping an ASGI stack there.

What it does: persistent connections (the SDK pools them), ``Content-Length`` and chunked request bodies,
fixed or chunked responses, and a per-request ``disconnected`` event. The event is how the SDK cancels an
execution: it drops the connection, and ``/execute`` interrupts the kernel. Reads are bounded (headers
64 KiB, body 16 MiB); a malformed request gets a 400 and the connection is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

log = logging.getLogger("aenv_interpreter.http")

MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 16 * 1024 * 1024
REASONS = {
    200: "OK",
    204: "No Content",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Payload Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


class BadRequest(Exception):
    """The bytes on the wire are not a request we accept; answered with ``status`` and the connection closed."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Request:
    method: str
    path: str
    query: str
    headers: dict[str, str]  # lower-cased names
    body: bytes

    def json(self) -> Any:
        """The body as JSON; an empty body is ``{}``. Raises ``BadRequest`` on invalid JSON."""
        if not self.body.strip():
            return {}
        try:
            return json.loads(self.body)
        except ValueError as exc:
            raise BadRequest(f"invalid JSON body: {exc}") from exc


class _Conn:
    """A byte buffer over the socket, so a watcher may read ahead without losing a pipelined request."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader
        self.buf = bytearray()
        self.eof = False

    async def fill(self) -> bool:
        data = await self.reader.read(65536)
        if not data:
            self.eof = True
            return False
        self.buf += data
        return True

    async def read_until(self, sep: bytes, limit: int) -> bytes | None:
        """Bytes up to and including ``sep``; None on a clean EOF before any byte."""
        while True:
            i = self.buf.find(sep)
            if i >= 0:
                out = bytes(self.buf[: i + len(sep)])
                del self.buf[: i + len(sep)]
                return out
            if len(self.buf) > limit:
                raise BadRequest("header section too large", 413)
            if not await self.fill():
                if not self.buf:
                    return None
                raise BadRequest("connection closed mid-request")

    async def read_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not await self.fill():
                raise BadRequest("connection closed mid-body")
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


class Response:
    """Writes one response: either ``send`` (whole body) or ``start`` + ``write``* + ``end`` (chunked)."""

    def __init__(self, writer: asyncio.StreamWriter, disconnected: asyncio.Event, keep_alive: bool) -> None:
        self._writer = writer
        self.disconnected = disconnected
        self.keep_alive = keep_alive
        self.started = False
        self.finished = False

    def _head(self, status: int, headers: dict[str, str]) -> bytes:
        lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}"]
        headers = {**headers, "Connection": "keep-alive" if self.keep_alive else "close"}
        lines += [f"{k}: {v}" for k, v in headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def send(
        self, status: int, body: bytes = b"", content_type: str = "text/plain; charset=utf-8"
    ) -> None:
        self.started = self.finished = True
        self._writer.write(
            self._head(status, {"Content-Type": content_type, "Content-Length": str(len(body))}) + body
        )
        await self._writer.drain()

    async def send_json(self, status: int, value: Any) -> None:
        await self.send(status, json.dumps(value).encode(), "application/json")

    async def start(self, status: int, content_type: str) -> None:
        self.started = True
        self._writer.write(self._head(status, {"Content-Type": content_type, "Transfer-Encoding": "chunked"}))
        await self._writer.drain()

    async def write(self, data: bytes) -> None:
        if data:
            self._writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await self._writer.drain()

    async def end(self) -> None:
        self.finished = True
        self._writer.write(b"0\r\n\r\n")
        await self._writer.drain()


Handler = Callable[[Request, Response], Awaitable[None]]


@dataclass
class HttpServer:
    """Serves ``handler`` on host:port. ``start`` returns once listening; ``aclose`` stops and waits."""

    handler: Handler
    host: str = "127.0.0.1"
    port: int = 0
    _server: asyncio.AbstractServer | None = field(default=None, init=False)
    _conns: set[asyncio.Task[None]] = field(default_factory=set, init=False)

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._on_conn, self.host, self.port, limit=1 << 20)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def serve_forever(self) -> None:
        assert self._server is not None, "call start() first"
        async with self._server:
            await self._server.serve_forever()

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for t in list(self._conns):
            t.cancel()
        for t in list(self._conns):
            with contextlib.suppress(BaseException):
                await t

    async def _on_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        conn = _Conn(reader)
        try:
            while await self._one(conn, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._conns.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _one(self, conn: _Conn, writer: asyncio.StreamWriter) -> bool:
        """Serve one request; False when the connection should close."""
        try:
            req = await _read_request(conn)
        except BadRequest as exc:
            resp = Response(writer, asyncio.Event(), keep_alive=False)
            await resp.send(exc.status, str(exc).encode())
            return False
        if req is None:
            return False
        keep_alive = req.headers.get("connection", "").lower() != "close"
        disconnected = asyncio.Event()
        resp = Response(writer, disconnected, keep_alive)

        async def watch() -> None:
            # Read ahead only to notice EOF; bytes of a pipelined request stay in conn.buf.
            while len(conn.buf) < MAX_HEADER_BYTES and await conn.fill():
                pass
            if conn.eof:
                disconnected.set()

        watcher = asyncio.create_task(watch())
        try:
            await self.handler(req, resp)
        except BadRequest as exc:
            if not resp.started:
                await resp.send(exc.status, str(exc).encode())
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception:
            log.exception("%s %s failed", req.method, req.path)
            if not resp.started:
                await resp.send(500, b"internal error")
            else:
                return False  # a half-written stream cannot be repaired; close so the client sees it
        finally:
            watcher.cancel()
            with contextlib.suppress(BaseException):
                await watcher
        return keep_alive and resp.finished and not conn.eof


async def _read_request(conn: _Conn) -> Request | None:
    head = await conn.read_until(b"\r\n\r\n", MAX_HEADER_BYTES)
    if head is None:
        return None
    lines = head.decode("latin-1").split("\r\n")
    try:
        method, target, version = lines[0].split(" ", 2)
    except ValueError as exc:
        raise BadRequest(f"bad request line {lines[0]!r}") from exc
    if not version.startswith("HTTP/1."):
        raise BadRequest(f"unsupported protocol {version!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise BadRequest(f"bad header line {line!r}")
        headers[name.strip().lower()] = value.strip()
    if version == "HTTP/1.0" and headers.get("connection", "").lower() != "keep-alive":
        headers["connection"] = "close"
    path, _, query = target.partition("?")
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = await _read_chunked(conn)
    else:
        try:
            length = int(headers.get("content-length", "0"))
        except ValueError as exc:
            raise BadRequest("bad Content-Length") from exc
        if length < 0 or length > MAX_BODY_BYTES:
            raise BadRequest("body too large", 413)
        body = await conn.read_exact(length)
    return Request(method.upper(), unquote(path), query, headers, body)


async def _read_chunked(conn: _Conn) -> bytes:
    body = bytearray()
    while True:
        size_line = await conn.read_until(b"\r\n", 1024)
        if size_line is None:
            raise BadRequest("connection closed mid-body")
        try:
            size = int(size_line.split(b";", 1)[0].strip(), 16)
        except ValueError as exc:
            raise BadRequest("bad chunk size") from exc
        if size == 0:
            while (await conn.read_until(b"\r\n", MAX_HEADER_BYTES)) not in (b"\r\n", None):
                pass  # trailers, ignored
            return bytes(body)
        if len(body) + size > MAX_BODY_BYTES:
            raise BadRequest("body too large", 413)
        body += await conn.read_exact(size)
        await conn.read_exact(2)

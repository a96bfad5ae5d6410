"""The sandbox proxy: HTTP requests carrying ``E2b-Sandbox-Id`` (or a ``<port>-<id>.`` Host) go into the
sandbox, everything else falls through to the control plane (spec §1.5).

A byte-level HTTP/1.1 relay over mux streams: the request head is rebuilt from the ASGI scope and written
with the first piece of the body in one frame; the response head is parsed by hand and the body is passed
on as it arrives (content-length, chunked or close-delimited), never buffered. Upstream streams are kept
per (sandbox, port) for keep-alive. When the client goes away, the upstream stream is closed: envd then
stops streaming but keeps the process running.

Why not an HTTP client library (it was httpcore + h11): re-encoding every request and response through
it cost more CPU per request than everything else in the proxy hop together.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

from aenv.core.orchestrator import Orchestrator
from aenv.errors import NotFound, PortNotOpen
from aenv.mux import ByteStream, MuxError, StreamRefused

log = logging.getLogger("aenv.proxy")

ENVD_PORT = 49983
_HOST_RE = re.compile(r"^(\d{1,5})-([a-z0-9][a-z0-9_-]{0,63})\.")
# Hop-by-hop request headers, plus the framing and ``expect`` ones that the relay sets itself (the
# front server already answered any ``Expect: 100-continue``).
_DROP_REQUEST = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"upgrade", b"proxy-authorization",
        b"content-length", b"transfer-encoding", b"expect",
    }
)
_DROP_RESPONSE = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"trailer", b"upgrade", b"proxy-authenticate"}
)
# envd's internal routes: only the orchestrator may call them, never a client through the proxy.
_ENVD_INTERNAL = {"/init"}

MAX_HEAD = 64 * 1024  # response head (status line + headers) size limit
_MAX_LINE = 4096  # chunk-size and trailer lines
IDLE_EXPIRY = 60.0  # seconds an idle upstream stream is kept (envd's own keep-alive is 330 s)
MAX_IDLE_PER_TARGET = 16
_SWEEP_EVERY = 256  # releases between sweeps of dead idle streams of other sandboxes

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class UpstreamError(Exception):
    """The sandbox side broke HTTP/1.1: closed early, or sent something unparseable."""


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


def _json_error(status: int, body: dict[str, Any]) -> tuple[int, bytes]:
    return status, json.dumps(body).encode()


# ---- HTTP/1.1 pieces ------------------------------------------------------------------------------


def request_head(scope: Scope) -> tuple[bytes, str | None]:
    """The upstream request head and the body framing: None (no body), "length" or "chunked".

    A body the client sent chunked is re-chunked; one with a Content-Length keeps it.
    """
    path = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string")
    parts = [scope["method"].encode("latin-1"), b" ", path]
    if query:
        parts += [b"?", query]
    parts.append(b" HTTP/1.1\r\n")
    framing: str | None = None
    length = b""
    has_host = False
    for name, value in scope["headers"]:
        if name in _DROP_REQUEST:
            if name == b"transfer-encoding":
                framing = "chunked"
            elif name == b"content-length":
                length = value.strip()
            continue
        if name == b"host":
            has_host = True
        parts += [name, b": ", value, b"\r\n"]
    if framing is None and length:
        if length != b"0":
            framing = "length"
        parts += [b"content-length: ", length, b"\r\n"]  # kept at 0 too: some servers want it on a POST
    elif framing == "chunked":
        parts.append(b"transfer-encoding: chunked\r\n")
    if not has_host:
        parts.append(b"host: sandbox\r\n")
    parts.append(b"\r\n")
    return b"".join(parts), framing


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data) if data else b""


def parse_response_head(head: bytes) -> tuple[int, bool, list[tuple[bytes, bytes]], dict[bytes, bytes]]:
    """(status, HTTP/1.1?, headers to pass on, framing headers lowercased) from the bytes before the
    blank line. Raises UpstreamError on garbage."""
    lines = head.split(b"\n")
    status_line = lines[0].rstrip(b"\r")
    try:
        version, code = status_line.split(b" ", 2)[:2]
        status = int(code)
    except ValueError:
        raise UpstreamError(f"bad status line {status_line[:80]!r}") from None
    if not version.startswith(b"HTTP/1.") or not 100 <= status <= 999:
        raise UpstreamError(f"bad status line {status_line[:80]!r}")
    headers: list[tuple[bytes, bytes]] = []
    framing: dict[bytes, bytes] = {}
    for raw in lines[1:]:
        line = raw.rstrip(b"\r")
        if not line:
            continue
        name, sep, value = line.partition(b":")
        name = name.strip().lower()
        if not sep or not name or b" " in name:
            raise UpstreamError(f"bad header line {line[:80]!r}")
        value = value.strip()
        if name in _DROP_RESPONSE:
            if name in framing:
                framing[name] += b"," + value
            else:
                framing[name] = value
            continue
        if name == b"content-length":
            if name in framing and framing[name] != value:
                raise UpstreamError("conflicting content-length headers")
            framing[name] = value
        headers.append((name, value))
    return status, version == b"HTTP/1.1", headers, framing


class ChunkedDecoder:
    """Incremental decoder of a chunked body: ``feed`` takes what it can from ``buf`` and returns the data."""

    __slots__ = ("state", "remaining")

    def __init__(self) -> None:
        self.state = 0  # 0 size line, 1 data, 2 CRLF after data, 3 trailers, 4 done
        self.remaining = 0

    @property
    def done(self) -> bool:
        return self.state == 4

    def feed(self, buf: bytearray) -> bytes:
        out: list[bytes] = []
        while buf and self.state != 4:
            if self.state == 1:
                take = min(self.remaining, len(buf))
                out.append(bytes(buf[:take]))
                del buf[:take]
                self.remaining -= take
                if not self.remaining:
                    self.state = 2
                continue
            end = buf.find(b"\n")
            if end < 0:
                if len(buf) > _MAX_LINE:
                    raise UpstreamError("chunk line too long")
                break
            line = bytes(buf[:end]).rstrip(b"\r")
            del buf[: end + 1]
            if self.state == 0:
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise UpstreamError(f"bad chunk size {line[:40]!r}") from None
                if size < 0:
                    raise UpstreamError("negative chunk size")
                self.remaining = size
                self.state = 1 if size else 3
            elif self.state == 2:
                if line:
                    raise UpstreamError("missing CRLF after chunk")
                self.state = 0
            elif not line:  # state 3: trailers (dropped) end with an empty line
                self.state = 4
        return b"".join(out) if len(out) != 1 else out[0]


# ---- upstream pool --------------------------------------------------------------------------------


class _Idle:
    __slots__ = ("stream", "since")

    def __init__(self, stream: ByteStream, since: float) -> None:
        self.stream = stream
        self.since = since


def _usable(stream: ByteStream) -> bool:
    # A stream whose mux session ended (sandbox paused, killed, rolled back or restarted under the
    # same ID) is closed; one the sandbox side hung up on is at EOF; one with unread bytes is confused.
    return not (stream.closed or stream.at_eof or stream.buffered)


class UpstreamPool:
    """Idle keep-alive mux streams per (sandbox, port), most recently used first."""

    def __init__(self, get_orchestrator: Callable[[], Orchestrator]) -> None:
        self._get = get_orchestrator
        self._idle: dict[tuple[str, int], list[_Idle]] = {}
        self._opening: dict[tuple[str, int], asyncio.Task[None]] = {}  # prewarms in flight
        self._releases = 0

    async def acquire(self, sandbox_id: str, port: int) -> tuple[ByteStream, bool]:
        """A stream to ``port`` in the sandbox and whether it was reused."""
        key = (sandbox_id, port)
        stream = await self._take_idle(key)
        if stream is None and key in self._opening:
            # A prewarm is opening one right now: waiting for it beats opening a second.
            with contextlib.suppress(Exception):
                await asyncio.shield(self._opening[key])
            stream = await self._take_idle(key)
        if stream is not None:
            return stream, True
        return await self.open(sandbox_id, port), False

    async def _take_idle(self, key: tuple[str, int]) -> ByteStream | None:
        idle = self._idle.get(key)
        if idle:
            now = time.monotonic()
            while idle:
                entry = idle.pop()
                if now - entry.since < IDLE_EXPIRY and _usable(entry.stream):
                    return entry.stream
                await entry.stream.aclose()
        return None

    def prewarm(self, sandbox_id: str, port: int) -> None:
        """Open a stream in the background and keep it idle for the next request."""
        key = (sandbox_id, port)
        if key in self._opening:
            return
        task = asyncio.create_task(self._prewarm(key), name=f"proxy-prewarm-{sandbox_id}")
        self._opening[key] = task
        task.add_done_callback(lambda _: self._opening.pop(key, None))

    async def _prewarm(self, key: tuple[str, int]) -> None:
        try:
            stream = await self.open(*key)
        except Exception as exc:  # noqa: BLE001 - the request will open (and report) on its own
            log.debug("sandbox=%s proxy prewarm of port %s failed: %r", key[0], key[1], exc)
            return
        await self.release(*key, stream)

    async def open(self, sandbox_id: str, port: int) -> ByteStream:
        return await self._get().open_stream(sandbox_id, port)

    async def release(self, sandbox_id: str, port: int, stream: ByteStream) -> None:
        if not _usable(stream):
            await stream.aclose()
            return
        idle = self._idle.setdefault((sandbox_id, port), [])
        idle.append(_Idle(stream, time.monotonic()))
        if len(idle) > MAX_IDLE_PER_TARGET:
            await idle.pop(0).stream.aclose()
        self._releases += 1
        if self._releases % _SWEEP_EVERY == 0:
            await self.sweep()

    async def sweep(self) -> None:
        """Drop dead and expired idle streams (of sandboxes nobody calls any more, too)."""
        now = time.monotonic()
        for key, idle in list(self._idle.items()):
            keep = []
            for entry in idle:
                if now - entry.since < IDLE_EXPIRY and _usable(entry.stream):
                    keep.append(entry)
                else:
                    await entry.stream.aclose()
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]

    async def aclose(self) -> None:
        for task in list(self._opening.values()):
            task.cancel()
        idle, self._idle = self._idle, {}
        for entries in idle.values():
            for entry in entries:
                await entry.stream.aclose()


# ---- one relayed exchange -------------------------------------------------------------------------


class _NoResponse(UpstreamError):
    """The upstream stream ended before a single response byte."""


class _Exchange:
    """State shared by the response relay (the request's own task) and the helper task that pumps the
    rest of the request body, then watches for the client's disconnect."""

    __slots__ = ("stream", "gone", "finished", "body_sent", "started", "reusable")

    def __init__(self, stream: ByteStream, body_sent: bool) -> None:
        self.stream = stream
        self.gone = False  # the client disconnected
        self.finished = False  # the response is complete: a disconnect now changes nothing
        self.body_sent = body_sent  # the whole request body went upstream
        self.started = False  # the response head went to the client
        self.reusable = False  # the upstream stream may carry the next request

    async def client_left(self) -> None:
        """Close the upstream stream: the relay, waiting on it, sees it end and gives up quietly."""
        if not self.finished and not self.gone:
            self.gone = True
            await self.stream.aclose()


async def _pump_and_watch(receive: Receive, chunked: bool, more_body: bool, ex: _Exchange) -> None:
    try:
        while more_body:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                await ex.client_left()
                return
            data = msg.get("body", b"")
            more_body = msg.get("more_body", False)
            if chunked:
                data = _chunk(data) + (b"" if more_body else b"0\r\n\r\n")
            if data:
                try:
                    await ex.stream.write(data)
                except MuxError:
                    return  # the stream is gone: the response relay sees it end
        ex.body_sent = True
        while (await receive())["type"] != "http.disconnect":
            pass
        await ex.client_left()
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - a broken client read ends the exchange like a disconnect
        log.debug("proxy: client read failed: %r", exc)
        await ex.client_left()


_HEAD_END = re.compile(rb"\r?\n\r?\n")


async def _relay_response(method: str, send: Send, stream: ByteStream, ex: _Exchange) -> None:
    """Read the response from ``stream`` and pass it to the client; sets ``ex.reusable`` at a clean end."""
    buf = bytearray()
    while True:  # informational (1xx) responses are dropped
        while True:
            m = _HEAD_END.search(buf)
            if m is not None:
                head = bytes(buf[: m.start()])
                del buf[: m.end()]
                break
            if len(buf) > MAX_HEAD:
                raise UpstreamError("response head too large")
            chunk = await stream.read()
            if not chunk:
                if buf:
                    raise UpstreamError("the sandbox closed the connection mid-response head")
                raise _NoResponse("the sandbox closed the connection without a response")
            buf += chunk
        status, http11, headers, framing = parse_response_head(head)
        if status >= 200:
            break
        if status == 101:
            raise UpstreamError("protocol upgrades are not relayed")
    keep_alive = http11 and b"close" not in framing.get(b"connection", b"").lower()
    length = -1  # -1: until EOF
    if method == "HEAD" or status in (204, 304):
        length = 0
        if status in (204, 304):  # the server would expect a body of that length
            headers = [(k, v) for k, v in headers if k != b"content-length"]
    elif b"transfer-encoding" in framing:
        if framing[b"transfer-encoding"].lower().rsplit(b",", 1)[-1].strip() == b"chunked":
            length = -2
        headers = [(k, v) for k, v in headers if k != b"content-length"]
    elif b"content-length" in framing:
        raw = framing[b"content-length"]
        if not raw.isdigit():
            raise UpstreamError(f"bad content-length {raw[:20]!r}")
        length = int(raw)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    ex.started = True

    if length >= 0:  # Content-Length (or no body)
        remaining = length
        data = b""
        if buf:
            data = bytes(buf[:remaining])
            if len(buf) > remaining:
                keep_alive = False  # bytes beyond the response: do not trust the stream again
            remaining -= len(data)
        while remaining:
            if data:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            data = await stream.read()
            if not data:
                raise UpstreamError("the sandbox closed the connection mid-body")
            if len(data) > remaining:
                data = data[:remaining]
                keep_alive = False
            remaining -= len(data)
        ex.finished = True
        await send({"type": "http.response.body", "body": data, "more_body": False})
    elif length == -2:  # chunked
        decoder = ChunkedDecoder()
        while True:
            data = decoder.feed(buf) if buf else b""
            if decoder.done:
                break
            if data:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            chunk = await stream.read()
            if not chunk:
                raise UpstreamError("the sandbox closed the connection mid-body")
            buf += chunk
        if buf:
            keep_alive = False
        ex.finished = True
        await send({"type": "http.response.body", "body": data, "more_body": False})
    else:  # until the upstream closes
        keep_alive = False
        if buf:
            await send({"type": "http.response.body", "body": bytes(buf), "more_body": True})
        while chunk := await stream.read():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        ex.finished = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    ex.reusable = keep_alive and ex.body_sent


class SandboxProxy:
    """ASGI middleware in front of the control-plane app."""

    def __init__(self, app: ASGIApp, get_orchestrator: Callable[[], Orchestrator]) -> None:
        self.app = app
        self._get = get_orchestrator
        self.pool = UpstreamPool(get_orchestrator)

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self.pool.aclose()

    def prewarm(self, sandbox_id: str) -> None:
        """Orchestrator.on_running hook: open an envd stream for a sandbox that just became usable, so
        the client's first request (typically right after create) skips the stream-opening round trip."""
        self.pool.prewarm(sandbox_id, ENVD_PORT)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            target = route(scope) or self._route_signed_files_url(scope)
            if target is not None:
                await self._proxy_http(scope, receive, send, *target)
                return
            if scope["path"] == "/files":
                # No routing header and no sandbox signed this URL: envd's answer for a bad signature.
                body = {"code": 401, "message": "invalid or missing file URL signature"}
                await self._respond(send, *_json_error(401, body))
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
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _proxy_http(self, scope: Scope, receive: Receive, send: Send, sandbox_id: str, port: int) -> None:
        if not 0 < port < 65536:
            body = {"code": 400, "message": f"invalid E2b-Sandbox-Port '{port}'"}
            await self._respond(send, *_json_error(400, body))
            return
        if port == ENVD_PORT and scope["path"] in _ENVD_INTERNAL:
            await self._respond(send, *_json_error(403, {"code": 403, "message": "internal envd route"}))
            return
        head, framing = request_head(scope)
        more_body = framing == "chunked"  # a chunked body may stay open (StreamInput): head first, at once
        if framing == "length":
            # The first piece of a sized body goes out with the head: one mux frame for most requests.
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            head += msg.get("body", b"")
            more_body = bool(msg.get("more_body", False))
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
                    log.info("sandbox=%s proxy port=%s failed mid-response: %r", sandbox_id, port, exc)
            elif isinstance(exc, NotFound):
                await self._error(send, sandbox_id, "The sandbox was not found")
            elif isinstance(exc, (StreamRefused, PortNotOpen)):
                await self._error(send, sandbox_id, "The sandbox is running but port is not open")
            else:
                log.info("sandbox=%s proxy port=%s failed: %r", sandbox_id, port, exc)
                name = "RemoteProtocolError" if isinstance(exc, (UpstreamError, MuxError)) else type(exc).__name__
                await self._error(send, sandbox_id, f"The sandbox is unreachable: {name}")
        finally:
            if helper is not None:
                helper.cancel()
            if ex is not None:
                ex.finished = True
                if ex.reusable and not ex.gone:
                    await self.pool.release(sandbox_id, port, ex.stream)
                else:
                    await ex.stream.aclose()

    async def _error(self, send: Send, sandbox_id: str, message: str) -> None:
        await self._respond(send, *_json_error(502, {"sandboxId": sandbox_id, "message": message, "code": 502}))

"""One request/response exchange over an upstream mux stream: the rest of the request body is pumped up
by a helper task while the response is relayed down as it arrives (by length, chunked or until the
stream ends), never buffered whole.

The helper then watches for the client's disconnect and closes the upstream stream: envd stops
streaming but keeps the process running. ``_Exchange`` is the state both sides share, and it decides
whether the stream may carry the next request.
"""

from __future__ import annotations

import asyncio
import logging

from aenv.mux import ByteStream, MuxError

from .codec import (
    CHUNKED,
    LAST_CHUNK,
    ChunkedDecoder,
    Headers,
    Receive,
    Scope,
    Send,
    UpstreamError,
    encode_chunk,
    keeps_alive,
    parse_response_head,
    request_head,
    response_framing,
    take_head,
)

log = logging.getLogger("aenv.proxy")

ResponseHead = tuple[int, bool, Headers, dict[bytes, bytes]]  # status, HTTP/1.1?, headers, framing headers


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
                data = encode_chunk(data) + (b"" if more_body else LAST_CHUNK)
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


async def start_request(scope: Scope, receive: Receive) -> tuple[bytes, str | None, bool] | None:
    """The request head for upstream, its body framing, and whether more body follows the head. The
    first piece of a sized body goes out with the head: one mux frame for most requests. None: the
    client left first."""
    head, framing = request_head(scope)
    more_body = framing == "chunked"  # a chunked body may stay open (StreamInput): head first, at once
    if framing == "length":
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        head += msg.get("body", b"")
        more_body = bool(msg.get("more_body", False))
    return head, framing, more_body


async def read_response_head(stream: ByteStream, buf: bytearray, upgrade: bool = False) -> ResponseHead:
    """The final response head off ``stream`` (informational 1xx ones are dropped; a 101 is final when the
    request asked for an ``upgrade``); what came after it stays in ``buf``."""
    while True:
        while (head := take_head(buf)) is None:
            chunk = await stream.read()
            if not chunk:
                if buf:
                    raise UpstreamError("the sandbox closed the connection mid-response head")
                raise _NoResponse("the sandbox closed the connection without a response")
            buf += chunk
        parsed = parse_response_head(head)
        if parsed[0] == 101:
            if upgrade:
                return parsed
            raise UpstreamError("the sandbox switched protocols on a request that asked for no upgrade")
        if parsed[0] >= 200:
            return parsed


async def _relay_response(method: str, send: Send, stream: ByteStream, ex: _Exchange) -> None:
    """Read the response from ``stream`` and pass it to the client; sets ``ex.reusable`` at a clean end."""
    buf = bytearray()
    head = await read_response_head(stream, buf)
    await relay_body(method, head, buf, send, stream, ex)


async def relay_body(
    method: str, head: ResponseHead, buf: bytearray, send: Send, stream: ByteStream, ex: _Exchange
) -> None:
    """Send the response ``head`` and then its body (``buf`` first, then ``stream``) to the client as it
    arrives; sets ``ex.reusable`` at a clean end."""
    status, http11, headers, framing = head
    keep_alive = keeps_alive(http11, framing)
    length, headers = response_framing(method, status, headers, framing)
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
    elif length == CHUNKED:
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
    else:  # UNTIL_EOF: until the upstream closes
        keep_alive = False
        if buf:
            await send({"type": "http.response.body", "body": bytes(buf), "more_body": True})
        while chunk := await stream.read():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        ex.finished = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    ex.reusable = keep_alive and ex.body_sent

"""Connect protocol (JSON codec) for envd: framing, call context and the three endpoint kinds.

Both E2B SDKs speak Connect with JSON only (spec §3.3):

* unary: plain JSON body in, plain JSON out; errors are ``{"code","message"}``
  with the HTTP status of the code;
* server-stream: one request envelope in; ``application/connect+json`` envelopes
  out, flushed as produced, closed by an end-stream envelope (flag 0x02) holding
  ``{}`` or ``{"error":{...}}``. Errors always travel in the end-stream envelope,
  even before the first message;
* client-stream: envelopes arrive on a request body that stays open; the answer
  uses the streaming format.

An envelope is ``flags (1 byte) | length (uint32 big-endian) | payload``.

This module is the edge where ``EnvdError`` becomes a wire error; handlers only
see decoded dicts and a ``CallContext``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aenv.envd.errors import (
    Canceled,
    DeadlineExceeded,
    EnvdError,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    Unimplemented,
)
from aenv.envd.fields import Message

log = logging.getLogger("aenv.envd.connect")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

FLAG_COMPRESSED = 0x01
FLAG_END_STREAM = 0x02
_HEADER = struct.Struct(">BI")

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
DEFAULT_KEEPALIVE_S = 90.0
STREAM_CONTENT_TYPE = b"application/connect+json"
UNARY_CONTENT_TYPE = b"application/json"


# --------------------------------------------------------------------------- framing


def encode_envelope(payload: Message, flags: int = 0) -> bytes:
    data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
    return _HEADER.pack(flags, len(data)) + data


def end_stream_envelope(error: EnvdError | None = None) -> bytes:
    return encode_envelope({"error": error.to_json()} if error else {}, FLAG_END_STREAM)


def decode_message(raw: bytes) -> Message:
    """Parse one JSON message; anything but a JSON object is ``InvalidArgument``."""
    try:
        value = json.loads(raw) if raw.strip() else {}
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidArgument(f"malformed JSON message: {exc}") from exc
    if not isinstance(value, dict):
        raise InvalidArgument("message must be a JSON object")
    return value


class EnvelopeDecoder:
    """Incremental envelope parser with a per-message size cap.

    Feed it body chunks as they arrive; it returns complete ``(flags, payload)``
    pairs and keeps partial bytes for the next chunk. ``finish`` rejects a body
    that stops in the middle of an envelope.
    """

    def __init__(self, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self._buf = bytearray()
        self._max = max_message_bytes

    def feed(self, chunk: bytes) -> list[tuple[int, bytes]]:
        self._buf += chunk
        out: list[tuple[int, bytes]] = []
        while len(self._buf) >= _HEADER.size:
            flags, length = _HEADER.unpack_from(self._buf)
            if length > self._max:
                raise ResourceExhausted(f"message of {length} bytes exceeds limit of {self._max} bytes")
            if flags & FLAG_COMPRESSED:
                raise Unimplemented("compressed envelopes are not supported")
            end = _HEADER.size + length
            if len(self._buf) < end:
                break
            out.append((flags, bytes(self._buf[_HEADER.size : end])))
            del self._buf[:end]
        return out

    def finish(self) -> None:
        if self._buf:
            raise InvalidArgument(f"truncated envelope: {len(self._buf)} trailing bytes")


# --------------------------------------------------------------------------- call context


@dataclass
class CallContext:
    """What a handler may know about the call: headers, deadline, keepalive interval."""

    headers: dict[str, str] = field(default_factory=dict)
    deadline: float | None = None  # event-loop time
    keepalive_interval: float = DEFAULT_KEEPALIVE_S

    @classmethod
    def from_scope(cls, scope: Scope) -> CallContext:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        ctx = cls(headers=headers)
        timeout = parse_timeout_ms(headers.get("connect-timeout-ms"))
        if timeout is not None:
            ctx.deadline = asyncio.get_running_loop().time() + timeout
        ctx.keepalive_interval = parse_keepalive(headers.get("keepalive-ping-interval"))
        return ctx

    @property
    def timeout(self) -> float | None:
        """Seconds left until the deadline (None without one)."""
        if self.deadline is None:
            return None
        return self.deadline - asyncio.get_running_loop().time()

    @property
    def username(self) -> str | None:
        """The user named by ``Authorization: Basic base64("<user>:")``, if any."""
        auth = self.headers.get("authorization", "")
        scheme, _, value = auth.partition(" ")
        if scheme.lower() != "basic" or not value:
            return None
        try:
            decoded = base64.b64decode(value.strip(), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError) as exc:
            raise InvalidArgument("malformed Authorization header") from exc
        user = decoded.partition(":")[0]
        return user or None


def parse_timeout_ms(value: str | None) -> float | None:
    if value is None or value == "":
        return None
    if not value.isdigit() or len(value) > 10:
        raise InvalidArgument(f"invalid Connect-Timeout-Ms: {value!r}")
    return int(value) / 1000.0


def parse_keepalive(value: str | None) -> float:
    try:
        seconds = float(value) if value else DEFAULT_KEEPALIVE_S
    except ValueError:
        return DEFAULT_KEEPALIVE_S
    return seconds if seconds > 0 else DEFAULT_KEEPALIVE_S


# --------------------------------------------------------------------------- plumbing


async def read_body(receive: Receive, limit: int = MAX_MESSAGE_BYTES) -> bytes:
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Canceled("client disconnected")
        body += message.get("body", b"")
        if len(body) > limit:
            raise ResourceExhausted(f"request body exceeds limit of {limit} bytes")
        if not message.get("more_body", False):
            return bytes(body)


def as_envd_error(exc: BaseException) -> EnvdError:
    """The single mapping from any handler failure to a Connect error."""
    if isinstance(exc, EnvdError):
        return exc
    log.error("unhandled error in envd handler", exc_info=exc)
    return Internal(f"internal error: {type(exc).__name__}: {exc}")


async def _start(send: Send, status: int, content_type: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type)],
        }
    )


async def _body(send: Send, data: bytes, more: bool) -> None:
    with contextlib.suppress(OSError):
        await send({"type": "http.response.body", "body": data, "more_body": more})


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _run_with_deadline(coro: Awaitable[Any], deadline: float | None) -> Any:
    if deadline is None:
        return await coro
    timeout = asyncio.timeout_at(deadline)
    try:
        async with timeout:
            return await coro
    except TimeoutError as exc:
        if timeout.expired():
            raise DeadlineExceeded("context deadline exceeded") from exc
        raise


# --------------------------------------------------------------------------- endpoints

UnaryHandler = Callable[[Message, CallContext], Awaitable[Message]]
StreamHandler = Callable[[Message, CallContext], AsyncIterator[Message]]
ClientStreamHandler = Callable[[AsyncIterator[Message], CallContext], Awaitable[Message]]


class UnaryEndpoint:
    """ASGI app for one unary method."""

    def __init__(self, handler: UnaryHandler, max_body: int = MAX_MESSAGE_BYTES) -> None:
        self.handler = handler
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            ctx = CallContext.from_scope(scope)
            content_type = ctx.headers.get("content-type", "application/json").split(";")[0].strip()
            if content_type not in ("application/json", ""):
                raise Unimplemented(f"unsupported content type {content_type!r}; only JSON is served")
            msg = decode_message(await read_body(receive, self.max_body))
            result = await _run_with_deadline(self.handler(msg, ctx), ctx.deadline)
            status, payload = 200, result
        except Exception as exc:  # noqa: BLE001 - the edge maps everything
            err = as_envd_error(exc)
            status, payload = err.http_status, err.to_json()
        data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
        await _start(send, status, UNARY_CONTENT_TYPE)
        await _body(send, data, more=False)


class _Done:
    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


async def with_keepalive(
    source: AsyncIterator[Message], interval: float, keepalive: Message
) -> AsyncIterator[Message]:
    """Yield from ``source``; yield ``keepalive`` whenever nothing came for ``interval`` seconds.

    The source runs in its own task feeding a small queue, so waiting with a
    timeout never cancels it halfway through a message.
    """
    queue: asyncio.Queue[Message | _Done] = asyncio.Queue(maxsize=16)

    async def produce() -> None:
        try:
            async for item in source:
                await queue.put(item)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            await queue.put(_Done(exc))
            return
        await queue.put(_Done())

    producer = asyncio.create_task(produce())
    try:
        while True:
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel that races its inner task.
            try:
                async with asyncio.timeout(interval):
                    item = await queue.get()
            except TimeoutError:
                yield keepalive
                continue
            if isinstance(item, _Done):
                if item.error is not None:
                    raise item.error
                return
            yield item
    finally:
        producer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await producer


class ServerStreamEndpoint:
    """ASGI app for one server-streaming method.

    ``keepalive`` is the message sent on idle streams. At the call's deadline the
    stream is cut with ``deadline_exceeded``, as connect-go's server does; a handler
    that also acts on the deadline (Start kills its process) sends nothing more, so
    the SDKs raise their TimeoutException rather than read a killed process's end.
    A client disconnect only stops streaming; the handler is cancelled and must
    not treat that as a reason to stop the work it streams about.
    """

    def __init__(self, handler: StreamHandler, keepalive: Message) -> None:
        self.handler = handler
        self.keepalive = keepalive

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            ctx = CallContext.from_scope(scope)
            msg = self._single_message(await read_body(receive))
        except Exception as exc:  # noqa: BLE001
            await _start(send, 200, STREAM_CONTENT_TYPE)
            await _body(send, end_stream_envelope(as_envd_error(exc)), more=False)
            return

        await _start(send, 200, STREAM_CONTENT_TYPE)
        ended: list[bool] = []  # set by _stream once it sent the end of the stream itself
        streamer = asyncio.create_task(self._stream(msg, ctx, send, ended))
        watcher = asyncio.create_task(_wait_disconnect(receive))
        timeout = None
        if ctx.deadline is not None:
            timeout = max(0.0, ctx.deadline - asyncio.get_running_loop().time())
        error: EnvdError | None = None
        try:
            done, _ = await asyncio.wait(
                {streamer, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if streamer in done:
                failure = streamer.exception()
                error = as_envd_error(failure) if failure is not None else None
            elif watcher in done:
                return  # client is gone: nothing more to send
            else:
                error = DeadlineExceeded("context deadline exceeded")
        finally:
            for task in (streamer, watcher):
                task.cancel()
            for task in (streamer, watcher):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if not ended:
            await _body(send, end_stream_envelope(error), more=False)

    @staticmethod
    def _single_message(body: bytes) -> Message:
        decoder = EnvelopeDecoder()
        frames = decoder.feed(body)
        decoder.finish()
        messages = [raw for flags, raw in frames if not flags & FLAG_END_STREAM]
        if len(messages) != 1:
            raise InvalidArgument(f"expected exactly one request message, got {len(messages)}")
        return decode_message(messages[0])

    async def _stream(self, msg: Message, ctx: CallContext, send: Send, ended: list[bool]) -> None:
        """Every message, then the end of the stream from this same task: a finished process's end
        event and the stream's end leave back to back, and the reader wakes once for both instead
        of again after the task hand-offs and clean-up in ``__call__``."""
        error: EnvdError | None = None
        try:
            source = self.handler(msg, ctx)
            async for item in with_keepalive(source, ctx.keepalive_interval, self.keepalive):
                await _body(send, encode_envelope(item), more=True)
        except Exception as exc:  # noqa: BLE001 - ends the stream with the error, as __call__ would
            error = as_envd_error(exc)
        ended.append(True)
        await _body(send, end_stream_envelope(error), more=False)


class ClientStreamEndpoint:
    """ASGI app for one client-streaming method (StreamInput).

    Envelopes are decoded as the chunked request body delivers them, so the
    handler acts on each input while the client keeps the body open.
    """

    def __init__(self, handler: ClientStreamHandler) -> None:
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            ctx = CallContext.from_scope(scope)
            result = await _run_with_deadline(self.handler(self._messages(receive), ctx), ctx.deadline)
            error: EnvdError | None = None
        except Exception as exc:  # noqa: BLE001
            error = as_envd_error(exc)
        await _start(send, 200, STREAM_CONTENT_TYPE)
        if error is None:
            await _body(send, encode_envelope(result), more=True)
        await _body(send, end_stream_envelope(error), more=False)

    @staticmethod
    async def _messages(receive: Receive) -> AsyncIterator[Message]:
        decoder = EnvelopeDecoder()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise Canceled("client disconnected")
            for flags, raw in decoder.feed(message.get("body", b"")):
                if flags & FLAG_END_STREAM:
                    continue
                yield decode_message(raw)
            if not message.get("more_body", False):
                decoder.finish()
                return

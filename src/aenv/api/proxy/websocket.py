"""WebSocket through the sandbox proxy: RL harnesses run each episode over one to ``sbx.get_host(port)``.

The front server (uvicorn) completes the client's handshake only when the app accepts, and then hands the
app whole messages (the ASGI ``websocket`` scope); it gives no application the raw connection. So the
relay is message by message: towards the sandbox the proxy is a WebSocket client over its own mux stream
(``wsframe``), and the sandbox's answer decides the client's — a 101 becomes the accept (with the
subprotocol and headers the sandbox chose), anything else is passed on as the HTTP denial response.

Each message is forwarded as soon as it is whole, in both directions, with back-pressure (the next one is
not read before this one is written); nothing times out while a connection lives. Pings are answered on
each hop: the front server answers the client's, the proxy the sandbox's. A close frame from either end is
passed to the other, and the stream is closed once the sandbox answered it (or ``CLOSE_TIMEOUT`` passed);
a connection that ends without one (a TCP half close, a crash) ends the other side the same way, so no
stream and no task outlives the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from aenv.mux import ByteStream, MuxError

from .codec import Message as AsgiMessage
from .codec import Receive, Scope, Send
from .relay import ResponseHead, _Exchange, read_response_head, relay_body
from .routing import json_error, upstream_error
from .wsframe import (
    BINARY,
    CLOSE,
    NO_STATUS,
    NORMAL,
    PONG,
    TEXT,
    Close,
    Event,
    FrameDecoder,
    Message,
    Ping,
    WsProtocolError,
    check_upgrade,
    close_payload,
    encode_frame,
    new_key,
    sendable,
    upgrade_request,
)

log = logging.getLogger("aenv.proxy")

CLOSE_TIMEOUT = 5.0  # seconds the sandbox has to answer a close frame before its stream is cut


async def deny(scope: Scope, send: Send, status: int, body: bytes) -> None:
    """Answer an upgrade that will not happen with an HTTP response (ASGI's denial response, which uvicorn
    offers), or, where the server has no such thing, by refusing it (the server then answers 403)."""
    if "websocket.http.response" in (scope.get("extensions") or {}):
        headers = [(b"content-type", b"application/json")]
        await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body, "more_body": False})
    else:
        await send({"type": "websocket.close", "code": 1008})


async def proxy_websocket(
    scope: Scope,
    receive: Receive,
    send: Send,
    sandbox_id: str,
    open_stream: Callable[[], Awaitable[ByteStream]],
    live: set[ByteStream],
    max_message: int,
) -> None:
    """Relay one WebSocket connection into the sandbox; returns when both sides are done with it.
    ``live`` holds the upstream stream while it is open (the proxy closes what is left at shutdown)."""
    if (await receive())["type"] != "websocket.connect":
        return  # the client left before the app saw it
    try:
        stream = await open_stream()
    except Exception as exc:  # noqa: BLE001 - no stream into the sandbox: an E2B 502, never a crash
        await deny(scope, send, *upstream_error(sandbox_id, exc))
        return
    live.add(stream)
    try:
        await _Relay(scope, stream, receive, send, max_message, sandbox_id).run()
    finally:
        live.discard(stream)
        await stream.aclose()


class _Relay:
    """One upgraded connection: ``_from_sandbox`` does the handshake and then relays the sandbox's frames
    to the client; ``_from_client`` (a helper task) relays the client's messages up. Both write frames to
    the one stream under a lock, so a pong never lands inside a message."""

    def __init__(
        self, scope: Scope, stream: ByteStream, receive: Receive, send: Send, max_message: int, sandbox_id: str
    ) -> None:
        self.scope = scope
        self.stream = stream
        self.receive = receive
        self.send = send
        self.sandbox_id = sandbox_id
        self.decoder = FrameDecoder(max_message)
        self.lock = asyncio.Lock()
        self.open = False  # the sandbox accepted and so did the client's side
        self.close_sent = False  # a close frame went to the sandbox
        self.client_gone = False  # the client's side ended: nothing more goes to it
        self.client_close: tuple[int, str] = (NO_STATUS, "")
        self.pong_due: bytes | None = None  # a pong to send after the frame being written

    async def run(self) -> None:
        client = asyncio.create_task(self._from_client(), name=f"proxy-ws-client-{self.sandbox_id}")
        sandbox = asyncio.create_task(self._from_sandbox(), name=f"proxy-ws-sandbox-{self.sandbox_id}")
        try:
            await asyncio.wait({client, sandbox}, return_when=asyncio.FIRST_COMPLETED)
            if not sandbox.done() and self.open:
                # The client's side ended: the sandbox hears of it and gets a moment to answer.
                await self._close_upstream(*self.client_close)
                await asyncio.wait({sandbox}, timeout=CLOSE_TIMEOUT)
        finally:
            for task in (client, sandbox):
                task.cancel()
            for result in await asyncio.gather(client, sandbox, return_exceptions=True):
                if isinstance(result, Exception):
                    log.info("sandbox=%s proxy websocket relay failed: %r", self.sandbox_id, result)

    async def _write(self, opcode: int, payload: bytes) -> None:
        frame = encode_frame(opcode, payload)
        async with self.lock:
            await self.stream.write(frame)
            while self.pong_due is not None:
                pong, self.pong_due = self.pong_due, None
                await self.stream.write(encode_frame(PONG, pong))

    async def _pong(self, payload: bytes) -> None:
        """Answer a ping; while a (large) frame is being written, right after it, so the sandbox's frames
        are read on meanwhile: a server that stops reading until it has written is never stuck on us."""
        if self.lock.locked():
            self.pong_due = payload  # only the latest ping needs its pong (RFC 6455 §5.5.3)
            return
        with contextlib.suppress(MuxError):
            await self._write(PONG, payload)

    async def _close_upstream(self, code: int, reason: str) -> None:
        if self.close_sent:
            return
        self.close_sent = True
        with contextlib.suppress(MuxError):
            await self._write(CLOSE, close_payload(code, reason))

    async def _to_client(self, message: AsgiMessage) -> None:
        if self.client_gone:
            return
        try:
            await self.send(message)
        except Exception:  # noqa: BLE001 - uvicorn raises once the client is gone; so be it
            self.client_gone = True

    async def _from_client(self) -> None:
        try:
            while True:
                msg = await self.receive()
                kind = msg["type"]
                if kind == "websocket.disconnect":
                    self.client_close = (int(msg.get("code") or NO_STATUS), str(msg.get("reason") or ""))
                    return
                if kind != "websocket.receive" or not self.open:
                    continue  # nothing else can come before the accept
                text = msg.get("text")
                if text is not None:
                    await self._write(TEXT, text.encode())
                else:
                    await self._write(BINARY, msg.get("bytes") or b"")
        except MuxError:
            pass  # the stream is gone: _from_sandbox sees it end
        finally:
            self.client_gone = True

    async def _from_sandbox(self) -> None:
        buf = bytearray()
        key = new_key()
        try:
            await self.stream.write(upgrade_request(self.scope, key))
            head = await read_response_head(self.stream, buf, upgrade=True)
            if head[0] != 101:
                await self._refused(head, buf)
                return
            subprotocol, headers = check_upgrade(key, head[2], head[3])
        except Exception as exc:  # noqa: BLE001 - the sandbox broke off or broke the handshake: a 502
            log.info("sandbox=%s proxy websocket handshake failed: %r", self.sandbox_id, exc)
            if not self.client_gone:
                with contextlib.suppress(Exception):
                    await deny(self.scope, self.send, *upstream_error(self.sandbox_id, exc))
            return
        await self._to_client({"type": "websocket.accept", "subprotocol": subprotocol, "headers": headers})
        self.open = not self.client_gone
        data = bytes(buf)
        while self.open:
            if data:
                fault = None
                try:
                    events = self.decoder.feed(data)
                except WsProtocolError as exc:
                    log.info("sandbox=%s proxy websocket: %s", self.sandbox_id, exc)
                    events, fault = exc.events, exc
                if await self._deliver(events):
                    return
                if fault is not None:
                    await self._close_upstream(fault.code, fault.reason)
                    await self._to_client({"type": "websocket.close", "code": fault.code, "reason": fault.reason})
                    return
            data = await self.stream.read()
            if not data:
                # Ended without a close frame: the client's connection is dropped the same way.
                log.debug("sandbox=%s proxy websocket: the sandbox side ended without a close", self.sandbox_id)
                return

    async def _deliver(self, events: list[Event]) -> bool:
        """Pass the sandbox's messages on and answer its pings; True once it closed."""
        for event in events:
            if isinstance(event, Message):
                key = "text" if isinstance(event.data, str) else "bytes"
                await self._to_client({"type": "websocket.send", key: event.data})
            elif isinstance(event, Ping):
                await self._pong(event.payload)
            elif isinstance(event, Close):
                await self._close_upstream(event.code, event.reason)  # the answer, unless the close was ours
                code = event.code if sendable(event.code) else NORMAL
                await self._to_client({"type": "websocket.close", "code": code, "reason": event.reason})
                return True
        return False

    async def _refused(self, head: ResponseHead, buf: bytearray) -> None:
        """The sandbox answered the upgrade with a plain response: the client gets that response."""
        if "websocket.http.response" not in (self.scope.get("extensions") or {}):
            await self._to_client({"type": "websocket.close", "code": 1008})
            return

        async def send_denial(message: AsgiMessage) -> None:
            await self.send({**message, "type": "websocket." + message["type"]})

        await relay_body("GET", head, buf, send_denial, self.stream, _Exchange(self.stream, body_sent=True))


def upgrade_refusal(tokens: list[bytes]) -> tuple[int, bytes]:
    """The 501 for an HTTP upgrade other than WebSocket: uvicorn hands the app no raw connection to switch."""
    names = ", ".join(t.decode("latin-1") for t in tokens)
    message = (f"the sandbox proxy relays WebSocket upgrades only; 'Upgrade: {names}' is not supported "
               "(the front server passes no raw connection through)")  # fmt: skip
    return json_error(501, {"code": 501, "message": message})

"""One multiplexed byte stream: bounded receive buffer, credit-based sending, half close."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Protocol

from aenv.mux.protocol import MAX_PAYLOAD, WINDOW_SIZE, Frame, FrameType, MuxError, ProtocolError, u32

if TYPE_CHECKING:
    from aenv.mux.session import MuxSession


class StreamClosed(MuxError):
    """The stream (or its whole channel) is gone; no more data can be written."""


class StreamRefused(MuxError):
    """The accepting side could not connect to the requested port."""


class ByteStream(Protocol):
    """What callers of a stream into a sandbox rely on: a ``MuxStream`` or a ``DirectStream``."""

    port: int

    @property
    def closed(self) -> bool: ...
    @property
    def buffered(self) -> int: ...
    @property
    def at_eof(self) -> bool: ...
    async def read(self, n: int = ...) -> bytes: ...
    async def write(self, data: bytes | bytearray | memoryview) -> None: ...
    async def write_eof(self) -> None: ...
    async def aclose(self) -> None: ...


class MuxStream:
    """A bidirectional byte stream inside a MuxSession.

    ``read`` returns b"" at end of stream (peer EOF or close). ``write`` waits for flow-control credit.
    ``aclose`` is idempotent and never raises.
    """

    def __init__(self, session: MuxSession, stream_id: int, port: int) -> None:
        self._session = session
        self.stream_id = stream_id
        self.port = port
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._data_ready = asyncio.Event()
        self._eof_received = False
        self._eof_sent = False
        self._closed = False
        self._close_reason: str | None = None
        self._send_credit = WINDOW_SIZE
        self._credit_ready = asyncio.Event()
        self._credit_ready.set()
        self._consumed_unacked = 0
        self.opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # ---- called by the session's reader ---------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        if self._closed or self._eof_received:
            return
        if self._buffered + len(data) > WINDOW_SIZE:
            raise ProtocolError(f"stream {self.stream_id}: peer exceeded the flow-control window")
        self._chunks.append(data)
        self._buffered += len(data)
        self._data_ready.set()

    def _feed_eof(self) -> None:
        self._eof_received = True
        self._data_ready.set()

    def _add_credit(self, n: int) -> None:
        self._send_credit += n
        self._credit_ready.set()

    def _abort(self, reason: str) -> None:
        """The peer or the channel ended this stream; wake every waiter."""
        if self._closed:
            return
        self._closed = True
        self._close_reason = reason
        self._eof_received = True
        self._data_ready.set()
        self._credit_ready.set()
        if not self.opened.done():
            self.opened.set_exception(StreamRefused(reason))
            self.opened.exception()  # mark retrieved: nobody may be waiting any more

    # ---- public API -----------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def buffered(self) -> int:
        """Bytes received and not read yet."""
        return self._buffered

    @property
    def at_eof(self) -> bool:
        return self._eof_received and not self._chunks

    async def read(self, n: int = MAX_PAYLOAD) -> bytes:
        while not self._chunks:
            if self._eof_received:
                return b""
            self._data_ready.clear()
            await self._data_ready.wait()
        chunk = self._chunks.popleft()
        if len(chunk) > n:
            self._chunks.appendleft(chunk[n:])
            chunk = chunk[:n]
        self._buffered -= len(chunk)
        self._consumed_unacked += len(chunk)
        if self._consumed_unacked >= WINDOW_SIZE // 4 and not self._closed:
            credit, self._consumed_unacked = self._consumed_unacked, 0
            await self._session._send(Frame(FrameType.WINDOW, self.stream_id, u32(credit)))
        return chunk

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(bytes(data))
        while view:
            if self._closed:
                raise StreamClosed(self._close_reason or "stream closed")
            if self._eof_sent:
                raise StreamClosed("write after write_eof")
            if self._send_credit <= 0:
                self._credit_ready.clear()
                await self._credit_ready.wait()
                continue
            size = min(len(view), MAX_PAYLOAD, self._send_credit)
            self._send_credit -= size
            await self._session._send(Frame(FrameType.DATA, self.stream_id, bytes(view[:size])))
            view = view[size:]

    async def write_eof(self) -> None:
        if self._closed or self._eof_sent:
            return
        self._eof_sent = True
        await self._session._send(Frame(FrameType.EOF, self.stream_id))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._abort("closed locally")
        try:
            await self._session._send(Frame(FrameType.CLOSE, self.stream_id))
        except MuxError:
            pass
        finally:
            self._session._forget(self.stream_id)

    def __repr__(self) -> str:
        return f"<MuxStream id={self.stream_id} port={self.port} closed={self._closed}>"

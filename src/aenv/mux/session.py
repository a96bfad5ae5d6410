"""A mux session over one ordered byte channel (unix socket, virtio-serial port).

The host is the *opening* side: ``await session.open(port)`` gives a MuxStream to that TCP port inside
the sandbox. The agent is the *accepting* side: it passes ``accept=`` and bridges every opened stream
to ``127.0.0.1:port`` in the sandbox.

Life of a session: ``start()`` sends HELLO and runs the reader task; ``aclose()`` (idempotent) ends it
and fails every stream with StreamClosed, so no caller can hang on a dead channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from collections.abc import Awaitable, Callable

from aenv.mux.protocol import (
    HEADER_SIZE,
    VERSION,
    Frame,
    FrameType,
    MuxError,
    ProtocolError,
    decode_header,
    parse_hello,
    parse_u16,
    parse_u32,
    u16,
)
from aenv.mux.stream import MuxStream, StreamClosed, StreamRefused

log = logging.getLogger("aenv.mux")

Connector = Callable[[int], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]

_PUMP_CHUNK = 64 * 1024
# PING numbers come from one counter for the whole process, not one per session: a vm guest slowed
# down (16 forks under TCG) may answer an abandoned session's PING after the host reconnected, and a
# new session counting from 1 again would take that stale PONG for its own, open streams before the
# guest has read its HELLO, and lose them when the guest's answering HELLO arrives ("peer restarted").
_PING_SEQ = itertools.count(secrets.randbelow(0x10000))


class MuxSession:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        accept: Connector | None = None,
        name: str = "mux",
        hello_extra: bytes = b"",
        on_hello: Callable[[bytes], None] | None = None,
    ) -> None:
        """``hello_extra``: bytes sent after the version in our HELLO; ``on_hello``: called with the
        peer's, synchronously in the reader, so it runs before any later frame of the session."""
        self._hello_extra = hello_extra
        self._on_hello = on_hello
        self._reader = reader
        self._writer = writer
        self._accept = accept
        self.name = name
        self._streams: dict[int, MuxStream] = {}
        # The opening side uses odd IDs, the accepting side even ones, so both could open. Each
        # session starts at a random point: frames a peer still emits for a previous session's
        # streams (a vm guest restored from a snapshot replays what was queued when it was taken)
        # then name no stream of this one and are dropped, instead of ending a new stream that
        # happens to reuse the ID.
        self._next_id = secrets.randbelow(1 << 30) * 2 + (2 if accept is not None else 1)
        self._send_lock = asyncio.Lock()
        self._reader_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._close_reason = ""
        self._pings: dict[int, asyncio.Future[None]] = {}
        self._peer_hello_seen = False
        self.closed_event = asyncio.Event()

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> MuxSession:
        await self._send_hello()
        self._reader_task = asyncio.create_task(self._read_loop(), name=f"{self.name}-reader")
        return self

    async def run(self) -> None:
        """Start (if needed) and wait until the channel ends. Used by the agent."""
        if self._reader_task is None:
            await self.start()
        await self.closed_event.wait()

    @property
    def closed(self) -> bool:
        return self._closed

    async def aclose(self, reason: str = "session closed") -> None:
        if self._closed:
            return
        self._shutdown(reason)
        tasks = [t for t in (self._reader_task, *self._tasks) if t is not None and t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        with contextlib.suppress(Exception):
            self._writer.close()

    def _shutdown(self, reason: str) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_reason = reason
        for stream in list(self._streams.values()):
            stream._abort(reason)
        self._streams.clear()
        for fut in self._pings.values():
            if not fut.done():
                fut.set_exception(StreamClosed(reason))
        self._pings.clear()
        self.closed_event.set()

    def abort_streams(self, reason: str) -> None:
        """Void every stream here, quietly (the channel stays): a vm host does this before the
        guest's vCPUs stop, so no idle keep-alive stream is reused into a stopped guest."""
        for stream in list(self._streams.values()):
            stream._abort(reason)
        self._streams.clear()

    async def restart(self, hello_extra: bytes) -> None:
        """Start over on the same channel with a new HELLO carrying ``hello_extra`` (a resumed vm
        guest's clock and seed). The peer voids its streams and, as the accepting side, answers
        with a HELLO of its own, which counts as its first again."""
        self._hello_extra = hello_extra
        self.abort_streams("session restarted")
        self._peer_hello_seen = False
        await self._send_hello()

    # ---- opening side ---------------------------------------------------------------------------
    async def open(self, port: int, timeout: float = 10.0) -> MuxStream:
        """Open a stream to ``port`` inside the sandbox. Raises StreamRefused or StreamClosed."""
        if self._closed:
            raise StreamClosed(self._close_reason or "session closed")
        if not 0 < port < 65536:
            raise ValueError(f"invalid port {port}")
        stream_id = self._alloc_id()
        stream = MuxStream(self, stream_id, port)
        self._streams[stream_id] = stream
        try:
            await self._send(Frame(FrameType.OPEN, stream_id, u16(port)))
            async with asyncio.timeout(timeout):
                await asyncio.shield(stream.opened)
        except TimeoutError:
            await stream.aclose()
            raise StreamRefused(f"port {port}: no answer within {timeout}s") from None
        except BaseException:
            await stream.aclose()
            raise
        return stream

    async def ping(self, timeout: float = 5.0) -> None:
        """Round trip through the peer; raises if the channel is dead."""
        if self._closed:
            raise StreamClosed(self._close_reason or "session closed")
        seq = next(_PING_SEQ) & 0xFFFF
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pings[seq] = fut
        try:
            await self._send(Frame(FrameType.PING, 0, u16(seq)))
            async with asyncio.timeout(timeout):
                await fut
        finally:
            self._pings.pop(seq, None)

    def _alloc_id(self) -> int:
        sid = self._next_id
        self._next_id += 2
        if self._next_id > 0xFFFFFFF0:
            self._next_id = 2 if self._accept is not None else 1
        return sid

    # ---- plumbing -------------------------------------------------------------------------------
    async def _send(self, frame: Frame) -> None:
        if self._closed and frame.type != FrameType.CLOSE:
            raise StreamClosed(self._close_reason or "session closed")
        data = frame.encode()
        async with self._send_lock:
            try:
                self._writer.write(data)
                await self._writer.drain()
            except (ConnectionError, OSError, RuntimeError) as exc:
                self._shutdown(f"channel write failed: {exc}")
                raise StreamClosed(str(exc)) from exc

    async def _send_hello(self) -> None:
        await self._send(Frame(FrameType.HELLO, 0, u16(VERSION) + self._hello_extra))

    def _forget(self, stream_id: int) -> None:
        self._streams.pop(stream_id, None)

    async def _read_loop(self) -> None:
        reason = "channel closed by peer"
        try:
            while True:
                header = await self._reader.readexactly(HEADER_SIZE)
                ftype, stream_id, length = decode_header(header)
                payload = await self._reader.readexactly(length) if length else b""
                await self._dispatch(ftype, stream_id, payload)
        except asyncio.IncompleteReadError:
            pass
        except (ConnectionError, OSError) as exc:
            reason = f"channel error: {exc}"
        except ProtocolError as exc:
            reason = f"protocol error: {exc} (raw={exc.raw!r})"
            log.warning("%s: %s", self.name, reason)
        except asyncio.CancelledError:
            reason = "session cancelled"
            raise
        finally:
            self._shutdown(reason)
            with contextlib.suppress(Exception):
                self._writer.close()

    async def _dispatch(self, ftype: FrameType, stream_id: int, payload: bytes) -> None:
        if ftype is FrameType.HELLO:
            version, extra = parse_hello(payload)
            if version != VERSION:
                raise ProtocolError(f"peer speaks mux version {version}, we speak {VERSION}")
            if extra and self._on_hello is not None:
                try:
                    self._on_hello(extra)
                except Exception as exc:  # noqa: BLE001 - a bad extension must not end the session
                    log.warning("%s: HELLO extension not applied: %s", self.name, exc)
            if not self._peer_hello_seen:
                self._peer_hello_seen = True
                return
            # A second HELLO on a live channel means the peer restarted: every old stream is void.
            if self._streams:
                log.info("%s: peer started a new session; %d open streams are void", self.name, len(self._streams))
            self.abort_streams("peer restarted")
            if self._accept is not None:
                # The accepting side (the vm agent, which keeps its session when a new host attaches:
                # agent.serial_readers) answers with a HELLO of its own, as on a fresh channel: the
                # new host then knows the agent's streams are gone too, and takes a later HELLO of
                # the agent's as a restart.
                await self._send_hello()
            return
        if ftype is FrameType.PING:
            await self._send(Frame(FrameType.PONG, 0, payload))
            return
        if ftype is FrameType.PONG:
            fut = self._pings.get(parse_u16(payload))
            if fut is not None and not fut.done():
                fut.set_result(None)
            return
        if ftype is FrameType.OPEN:
            self._on_open(stream_id, parse_u16(payload))
            return
        found = self._streams.get(stream_id)
        if found is None:
            # Frames for streams we already dropped are normal after a local close; ignore them.
            return
        stream = found
        if ftype is FrameType.OPEN_OK:
            if not stream.opened.done():
                stream.opened.set_result(None)
        elif ftype is FrameType.OPEN_ERR:
            self._streams.pop(stream_id, None)
            stream._abort(payload.decode("utf-8", "replace") or "refused")
        elif ftype is FrameType.DATA:
            try:
                stream._feed(payload)
            except ProtocolError as exc:
                log.warning("%s: %s", self.name, exc)
                await stream.aclose()
        elif ftype is FrameType.EOF:
            stream._feed_eof()
        elif ftype is FrameType.CLOSE:
            self._streams.pop(stream_id, None)
            stream._abort("closed by peer")
        elif ftype is FrameType.WINDOW:
            stream._add_credit(parse_u32(payload))

    # ---- accepting side -------------------------------------------------------------------------
    def _on_open(self, stream_id: int, port: int) -> None:
        if self._accept is None:
            asyncio.create_task(self._send_quietly(Frame(FrameType.OPEN_ERR, stream_id, b"opening not accepted here")))
            return
        stream = MuxStream(self, stream_id, port)
        self._streams[stream_id] = stream
        task = asyncio.create_task(self._bridge(stream), name=f"{self.name}-bridge-{stream_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_quietly(self, frame: Frame) -> None:
        with contextlib.suppress(MuxError):
            await self._send(frame)

    async def _bridge(self, stream: MuxStream) -> None:
        assert self._accept is not None
        try:
            reader, writer = await self._accept(stream.port)
        except Exception as exc:  # noqa: BLE001 - any connect failure is reported to the opener
            self._streams.pop(stream.stream_id, None)
            stream._abort("refused")
            await self._send_quietly(Frame(FrameType.OPEN_ERR, stream.stream_id, f"port {stream.port}: {exc}".encode()))
            return
        try:
            await self._send(Frame(FrameType.OPEN_OK, stream.stream_id))
            await bridge_streams(stream, reader, writer)
        except MuxError:
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()
            await stream.aclose()


async def bridge_streams(stream: MuxStream, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Pipe bytes both ways between a mux stream and a TCP/unix connection until both sides end.

    A half close travels as a half close; a reset of the mux stream closes the connection at once.
    """

    async def tcp_to_mux() -> None:
        try:
            while chunk := await reader.read(_PUMP_CHUNK):
                await stream.write(chunk)
            await stream.write_eof()
        except (ConnectionError, OSError, MuxError):
            await stream.aclose()

    async def mux_to_tcp() -> None:
        try:
            while chunk := await stream.read(_PUMP_CHUNK):
                writer.write(chunk)
                await writer.drain()
            if stream.closed:
                writer.close()
            elif writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError, MuxError):
            writer.close()
            await stream.aclose()

    await asyncio.gather(tcp_to_mux(), mux_to_tcp())


async def open_unix_session(path: str, *, name: str = "mux", timeout: float = 5.0) -> MuxSession:
    """Connect the opening side of a session to a unix socket (the ns agent's channel)."""
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_unix_connection(path, limit=1 << 20)
    return await MuxSession(reader, writer, name=name).start()

"""asyncio QMP client: greeting, ``qmp_capabilities``, ``execute`` with per-command ids, events.

A single reader task owns the inbound side. Each ``execute`` registers a future under a fresh id;
the reader resolves it when the matching reply arrives. If the connection ends, every pending
future fails with :class:`ExecInterruptedError`, so no caller can hang on a dead QEMU. Replies with
unknown ids are logged and dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from collections.abc import Iterator
from typing import Any, Self

from .errors import ConnectError, ExecInterruptedError, ExecuteError, ProtocolError, QMPError
from .events import EventListener
from .message import DEFAULT_FRAME_LIMIT, Message, command
from .protocol import FramedStream, Runstate, require

log = logging.getLogger(__name__)


class QMPClient:
    """One QMP connection. Use ``async with`` or call :meth:`disconnect` (idempotent)."""

    def __init__(self, name: str = "qmp", frame_limit: int = DEFAULT_FRAME_LIMIT) -> None:
        self.name = name
        self.greeting: Message | None = None
        self.runstate = Runstate.IDLE
        self._frame_limit = frame_limit
        self._stream: FramedStream | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._pending: dict[str, asyncio.Future[Message]] = {}
        self._listeners: list[EventListener] = []
        self._ids = itertools.count(1)
        self._id_prefix = f"{os.getpid():x}"
        self._send_lock = asyncio.Lock()
        self._failure: BaseException | None = None

    # -- connecting -------------------------------------------------------------------------------

    async def connect(self, path: str | os.PathLike[str], timeout: float = 5.0, retry: bool = True) -> None:
        """Connect to a unix socket and negotiate. With ``retry``, waits for QEMU to create the socket."""
        require(Runstate.IDLE, self.runstate, "connect")
        try:
            async with asyncio.timeout(timeout):
                while True:
                    try:
                        reader, writer = await asyncio.open_unix_connection(os.fspath(path), limit=64 * 1024)
                        break
                    except (FileNotFoundError, ConnectionRefusedError):
                        if not retry:
                            raise
                        await asyncio.sleep(0.005)
        except (OSError, TimeoutError) as exc:
            raise ConnectError(f"{self.name}: cannot connect to {os.fspath(path)}") from exc
        await self.connect_streams(reader, writer, timeout=timeout)

    async def connect_streams(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout: float = 5.0
    ) -> None:
        """Take over an open stream pair (used by tests with a socketpair) and negotiate."""
        require(Runstate.IDLE, self.runstate, "connect")
        self.runstate = Runstate.CONNECTING
        self._stream = FramedStream(reader, writer, self._frame_limit)
        self._failure = None
        try:
            async with asyncio.timeout(timeout):
                greeting = await self._stream.read()
                if greeting is None or "QMP" not in greeting:
                    raise ProtocolError(f"{self.name}: expected a QMP greeting, got {greeting!r}")
                self.greeting = greeting
                self._reader_task = asyncio.create_task(self._read_loop(), name=f"{self.name}-reader")
                self.runstate = Runstate.RUNNING
                await self.execute("qmp_capabilities")
        except asyncio.CancelledError:
            await self._teardown()
            raise
        except (QMPError, OSError, TimeoutError) as exc:
            await self._teardown()
            raise ConnectError(f"{self.name}: negotiation failed: {exc}") from exc

    # -- commands ---------------------------------------------------------------------------------

    async def execute(self, name: str, arguments: dict[str, Any] | None = None) -> Any:
        """Run a command and return its ``return`` value; raises ExecuteError with the evidence."""
        require(Runstate.RUNNING, self.runstate, f"execute({name})")
        assert self._stream is not None
        ident = f"{self._id_prefix}-{next(self._ids)}"
        msg = command(name, arguments, ident)
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._pending[ident] = fut
        try:
            async with self._send_lock:
                try:
                    await self._stream.write(msg)
                except OSError as exc:
                    raise ExecInterruptedError(f"{self.name}: {name}: send failed: {exc}") from exc
            reply = await fut
        finally:
            self._pending.pop(ident, None)
        if "error" in reply:
            raise ExecuteError(msg, reply)
        return reply.get("return")

    # -- events -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def listen(self, *names: str) -> Iterator[EventListener]:
        """Receive events named ``names`` (all if none) for the duration of the ``with`` block."""
        listener = EventListener(names)
        self._listeners.append(listener)
        try:
            yield listener
        finally:
            self._listeners.remove(listener)

    # -- inbound ----------------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        assert self._stream is not None
        reason: BaseException | None = None
        try:
            while True:
                msg = await self._stream.read()
                if msg is None:
                    break
                self._dispatch(msg)
        except asyncio.CancelledError:
            reason = None
            raise
        except QMPError as exc:
            reason = exc
            log.warning("%s: reader stopped: %s", self.name, exc)
        except OSError as exc:  # the peer went away (QEMU killed or crashed): not ours to shout about
            reason = exc
            log.debug("%s: connection lost: %s", self.name, exc)
        finally:
            self._failure = reason
            self._fail_pending(reason)
            if self.runstate is Runstate.RUNNING:
                self.runstate = Runstate.DISCONNECTING

    def _dispatch(self, msg: Message) -> None:
        if "event" in msg:
            for listener in list(self._listeners):
                if listener.accepts(msg):
                    listener.put(msg)
            return
        ident = msg.get("id")
        fut = self._pending.get(ident) if isinstance(ident, str) else None
        if fut is None:
            log.warning("%s: dropping reply with unknown id: %.200r", self.name, msg)
            return
        if not fut.done():
            fut.set_result(msg)

    def _fail_pending(self, reason: BaseException | None) -> None:
        for ident, fut in list(self._pending.items()):
            if not fut.done():
                err = ExecInterruptedError(f"{self.name}: connection closed before reply to {ident}")
                err.__cause__ = reason
                fut.set_exception(err)

    # -- closing ----------------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return (
            self.runstate is Runstate.RUNNING
            and self._reader_task is not None
            and not self._reader_task.done()
        )

    async def disconnect(self) -> None:
        """Close the connection and fail pending commands. Idempotent; finishes even if cancelled."""
        if self.runstate is Runstate.IDLE:
            return
        self.runstate = Runstate.DISCONNECTING
        await asyncio.shield(self._teardown())

    async def _teardown(self) -> None:
        task, self._reader_task = self._reader_task, None
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.close()
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._fail_pending(None)
        self.runstate = Runstate.IDLE

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.disconnect()

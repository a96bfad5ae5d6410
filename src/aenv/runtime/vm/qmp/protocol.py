"""Transport layer: run states and bounded, newline-framed reads/writes over an asyncio stream pair.

Kept apart from :mod:`.client` so the QMP semantics (greeting, ids, events) never deal with bytes.
"""

from __future__ import annotations

import asyncio
import enum
from typing import Any

from .errors import FrameTooLargeError, StateError
from .message import DEFAULT_FRAME_LIMIT, Message, decode, encode


class Runstate(enum.Enum):
    """Where a client is in its life. Transitions: IDLE → CONNECTING → RUNNING → DISCONNECTING → IDLE."""

    IDLE = "idle"
    CONNECTING = "connecting"
    RUNNING = "running"
    DISCONNECTING = "disconnecting"


def require(state: Runstate, have: Runstate, what: str) -> None:
    """Raise a StateError that says what to do, unless ``have`` is ``state``."""
    if have is not state:
        hint = "call connect() first" if have is Runstate.IDLE else "wait for the current transition"
        raise StateError(f"{what} needs state {state.value}, client is {have.value}; {hint}")


class FramedStream:
    """Reads and writes whole QMP frames. Owns the writer: :meth:`close` closes the transport once."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, limit: int = DEFAULT_FRAME_LIMIT
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._limit = limit
        self._closed = False

    async def read(self) -> Message | None:
        """The next frame, or None at EOF. Blank lines are skipped."""
        while True:
            line = await self._read_line()
            if line is None:
                return None
            if line.strip():
                return decode(line)

    async def _read_line(self) -> bytes | None:
        buf = bytearray()
        while True:
            try:
                chunk = await self._reader.readuntil(b"\n")
            except asyncio.IncompleteReadError as exc:
                if exc.partial or buf:
                    buf += exc.partial
                    return bytes(buf)  # a final unterminated frame: let decode judge it
                return None
            except asyncio.LimitOverrunError as exc:
                # The stream's own buffer limit was hit before a newline: take what is there and go on.
                chunk = await self._reader.readexactly(exc.consumed)
                buf += chunk
                if len(buf) > self._limit:
                    raise FrameTooLargeError(f"QMP frame exceeds {self._limit} bytes") from None
                continue
            buf += chunk
            if len(buf) > self._limit:
                raise FrameTooLargeError(f"QMP frame exceeds {self._limit} bytes")
            return bytes(buf)

    async def write(self, msg: Message) -> None:
        self._writer.write(encode(msg))
        await self._writer.drain()

    async def close(self) -> None:
        """Close the transport; safe to call twice and never raises for an already-broken pipe."""
        if self._closed:
            return
        self._closed = True
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except (OSError, RuntimeError):
            pass

    @property
    def extra(self) -> Any:
        return self._writer.get_extra_info("peername")

"""Keep-alive for the proxy: idle mux streams kept per (sandbox, port), so a request usually skips the
round trip of opening a stream into the sandbox.

A kept stream can die while idle (the sandbox paused, was killed, rolled back or restarted under the same
ID); every stream is checked before reuse and the dead ones are swept out now and then, so a sandbox
nobody calls any more does not keep its streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Protocol

from aenv.mux import ByteStream

log = logging.getLogger("aenv.proxy")

IDLE_EXPIRY = 60.0  # seconds an idle upstream stream is kept (envd's own keep-alive is 330 s)
MAX_IDLE_PER_TARGET = 16
_SWEEP_EVERY = 256  # releases between sweeps of dead idle streams of other sandboxes


class StreamOpener(Protocol):
    """Who opens the streams: the orchestrator (into a sandbox) or the gateway (to the sandbox's node)."""

    async def open_stream(self, sandbox_id: str, port: int) -> ByteStream: ...


class _Idle:
    __slots__ = ("stream", "since")

    def __init__(self, stream: ByteStream, since: float) -> None:
        self.stream = stream
        self.since = since


def _usable(stream: ByteStream) -> bool:
    # A stream whose mux session ended (sandbox paused, killed, rolled back or restarted under the
    # same ID) is closed; one the sandbox side hung up on is at EOF; one with unread bytes is confused.
    return not (stream.closed or stream.at_eof or stream.buffered)


def _alive(entry: _Idle, now: float) -> bool:
    return now - entry.since < IDLE_EXPIRY and _usable(entry.stream)


class UpstreamPool:
    """Idle keep-alive mux streams per (sandbox, port), most recently used first."""

    max_idle = MAX_IDLE_PER_TARGET  # idle streams kept per key

    def __init__(self, get_orchestrator: Callable[[], StreamOpener]) -> None:
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
                if _alive(entry, now):
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
        if len(idle) > self.max_idle:
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
                if _alive(entry, now):
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

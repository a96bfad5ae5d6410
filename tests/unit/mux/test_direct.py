"""DirectStream keeps the MuxStream contract over a plain unix connection: EOF as b"", StreamClosed on
writes to a dead peer, idempotent aclose, and the closed/at_eof/buffered flags the proxy's pool uses to
tell a reusable idle stream from a dead one."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aenv.mux import StreamClosed
from aenv.mux.direct import DirectStream, open_direct


class Peer:
    """The sandbox side: a unix server handing each accepted connection to the test."""

    def __init__(self) -> None:
        self.conns: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()
        self.writers: list[asyncio.StreamWriter] = []

    async def on_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        await self.conns.put((reader, writer))


@contextlib.asynccontextmanager
async def serving(tmp_path: Path) -> AsyncIterator[tuple[Peer, str]]:
    """In the test's own loop (an async fixture may run in another one)."""
    peer = Peer()
    path = str(tmp_path / "envd.sock")
    server = await asyncio.start_unix_server(peer.on_conn, path)
    try:
        yield peer, path
    finally:
        for writer in peer.writers:
            writer.transport.abort()
        server.close()
        await server.wait_closed()


async def test_round_trip_and_half_close(tmp_path: Path) -> None:
    async with serving(tmp_path) as (peer, path):
        stream = await open_direct(path, 49983)
        reader, writer = await peer.conns.get()
        await stream.write(b"ping")
        assert await reader.readexactly(4) == b"ping"
        await stream.write_eof()
        assert await reader.read() == b""  # the peer saw our EOF ...
        writer.write(b"pong")  # ... and can still answer
        await writer.drain()
        assert await stream.read(2) == b"po"
        assert stream.buffered == 2 and not stream.at_eof
        assert await stream.read() == b"ng"
        writer.close()
        assert await stream.read() == b""
        assert stream.at_eof and stream.port == 49983
        await stream.aclose()


async def test_peer_gone_makes_stream_unusable(tmp_path: Path) -> None:
    async with serving(tmp_path) as (peer, path):
        stream = await open_direct(path, 49983)
        _, writer = await peer.conns.get()
        writer.transport.abort()
        assert await stream.read() == b""
        assert stream.at_eof  # the pool drops it
        with pytest.raises(StreamClosed):  # the broken pipe surfaces on a write soon after
            for _ in range(100):
                await stream.write(b"late")
                await asyncio.sleep(0.01)
        assert stream.closed


async def test_aclose_is_idempotent_wakes_readers_and_reports(tmp_path: Path) -> None:
    async with serving(tmp_path) as (_, path):
        stream = await open_direct(path, 49983)
        closed: list[DirectStream] = []
        stream.on_close(closed.append)
        pending = asyncio.create_task(stream.read())
        await asyncio.sleep(0)
        await stream.aclose()
        await stream.aclose()
        assert await asyncio.wait_for(pending, 5) == b""
        assert stream.closed and closed == [stream]
        with pytest.raises(StreamClosed):
            await stream.write(b"x")


async def test_large_transfer_with_back_pressure(tmp_path: Path) -> None:
    async with serving(tmp_path) as (peer, path):
        stream = await open_direct(path, 1)
        reader, writer = await peer.conns.get()
        blob = bytes(range(256)) * 16384  # 4 MiB: more than the read limit, so reading pauses and resumes
        writer.write(blob)
        writer.write_eof()
        got = bytearray()
        while chunk := await stream.read():
            got += chunk
        assert bytes(got) == blob
        echo = asyncio.create_task(reader.readexactly(len(blob)))
        await stream.write(blob)
        assert await asyncio.wait_for(echo, 10) == blob
        await stream.aclose()


async def test_nobody_listening_is_an_oserror(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        await open_direct(str(tmp_path / "missing.sock"), 49983)

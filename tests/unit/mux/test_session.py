"""The mux over a socketpair: open/refuse, echo, flow control, half close, channel loss."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable

import pytest

from aenv.mux import MuxSession, StreamClosed, StreamRefused
from aenv.mux.protocol import (
    HEADER_SIZE,
    VERSION,
    WINDOW_SIZE,
    Frame,
    FrameType,
    ProtocolError,
    decode_header,
    u16,
)


async def _echo_server() -> tuple[asyncio.AbstractServer, int]:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        finally:  # also when the test's loop ends first and cancels this handler
            w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _pair(
    ports: dict[int, int],
    *,
    on_accept: Callable[[int], None] | None = None,
    agent_on_hello: Callable[[bytes], None] | None = None,
    host_hello: bytes = b"",
    host_on_hello: Callable[[bytes], None] | None = None,
) -> tuple[MuxSession, MuxSession]:
    a, b = socket.socketpair()

    async def accept(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if on_accept is not None:
            on_accept(port)
        if port not in ports:
            raise ConnectionRefusedError(f"nothing on {port}")
        return await asyncio.open_connection("127.0.0.1", ports[port])

    hr, hw = await asyncio.open_unix_connection(sock=a)
    ar, aw = await asyncio.open_unix_connection(sock=b)
    agent = MuxSession(ar, aw, accept=accept, name="agent", on_hello=agent_on_hello)
    host = MuxSession(hr, hw, name="host", hello_extra=host_hello, on_hello=host_on_hello)
    await agent.start()
    await host.start()
    return host, agent


async def test_echo_roundtrip_and_many_streams() -> None:
    server, port = await _echo_server()
    host, agent = await _pair({7: port})
    try:
        streams = [await host.open(7) for _ in range(20)]
        for i, s in enumerate(streams):
            await s.write(f"hello {i}".encode())
        for i, s in enumerate(streams):
            assert await s.read() == f"hello {i}".encode()
        for s in streams:
            await s.aclose()
        await host.ping()
    finally:
        await host.aclose()
        await agent.aclose()
        server.close()


async def test_large_transfer_respects_window() -> None:
    server, port = await _echo_server()
    host, agent = await _pair({7: port})
    try:
        s = await host.open(7)
        payload = os.urandom(3 * WINDOW_SIZE + 123)

        async def writer() -> None:
            await s.write(payload)
            await s.write_eof()

        task = asyncio.create_task(writer())
        received = bytearray()
        while chunk := await s.read():
            received += chunk
        await task
        assert bytes(received) == payload
    finally:
        await host.aclose()
        await agent.aclose()
        server.close()


async def test_refused_port_raises() -> None:
    host, agent = await _pair({})
    try:
        with pytest.raises(StreamRefused, match="nothing on 9"):
            await host.open(9)
        await host.ping()  # the session survives a refused stream
    finally:
        await host.aclose()
        await agent.aclose()


async def test_channel_loss_fails_streams() -> None:
    server, port = await _echo_server()
    host, agent = await _pair({7: port})
    s = await host.open(7)
    await agent.aclose()
    assert await s.read() == b""
    with pytest.raises(StreamClosed):
        for _ in range(100):
            await s.write(b"x" * 1024)
            await asyncio.sleep(0.01)
    with pytest.raises(StreamClosed):
        await host.open(7)
    await host.aclose()
    server.close()


def test_decode_rejects_garbage() -> None:
    with pytest.raises(ProtocolError):
        decode_header(b"\xff" * 12)
    with pytest.raises(ProtocolError):
        decode_header(Frame(FrameType.DATA, 1).encode()[:8])
    big = bytearray(Frame(FrameType.DATA, 1).encode())
    big[8:12] = (10**7).to_bytes(4, "big")
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_header(bytes(big))


async def test_frames_of_a_previous_session_do_not_end_a_new_stream() -> None:
    """A vm guest restored from a snapshot may replay frames its agent queued for the snapshot's
    session (a late CLOSE, say). Sessions start their IDs at random points, so such a frame names no
    stream of the new session and is dropped."""
    server, port = await _echo_server()
    old_host, old_agent = await _pair({7: port})
    host, agent = await _pair({7: port})
    try:
        old_stream = await old_host.open(7)
        stream = await host.open(7)
        assert stream.stream_id % 2 == 1 and stream.stream_id != old_stream.stream_id
        # the agent side replays the old session's CLOSE on the new channel
        await agent._send(Frame(FrameType.CLOSE, old_stream.stream_id))
        await stream.write(b"still here")
        assert await stream.read() == b"still here"
        assert not stream.closed
    finally:
        for s in (old_host, old_agent, host, agent):
            await s.aclose()
        server.close()


async def test_a_stale_pong_does_not_answer_a_new_sessions_ping() -> None:
    """A slow vm guest answers an abandoned session's PING after the host reconnected: the new
    session's ping must wait for its own PONG (PING numbers never repeat within the process), or the
    host opens streams the guest's answering HELLO then voids."""

    async def raw_session() -> tuple[MuxSession, asyncio.StreamReader, asyncio.StreamWriter]:
        a, b = socket.socketpair()
        hr, hw = await asyncio.open_unix_connection(sock=a)
        pr, pw = await asyncio.open_unix_connection(sock=b)
        host = await MuxSession(hr, hw, name="host").start()
        return host, pr, pw

    async def read_ping(reader: asyncio.StreamReader) -> bytes:
        while True:
            ftype, _, length = decode_header(await reader.readexactly(HEADER_SIZE))
            payload = await reader.readexactly(length) if length else b""
            if ftype is FrameType.PING:
                return payload

    old, old_r, old_w = await raw_session()
    old_ping = asyncio.create_task(old.ping(timeout=5))
    stale = await read_ping(old_r)
    old_ping.cancel()
    host, peer_r, peer_w = await raw_session()
    try:
        ping = asyncio.create_task(host.ping(timeout=5))
        mine = await read_ping(peer_r)
        assert mine != stale
        peer_w.write(Frame(FrameType.PONG, 0, stale).encode())  # the abandoned session's answer
        await asyncio.sleep(0.1)
        assert not ping.done()
        peer_w.write(Frame(FrameType.PONG, 0, mine).encode())
        await asyncio.wait_for(ping, 5)
    finally:
        for s in (old, host):
            await s.aclose()
        for w in (old_w, peer_w):
            w.close()


async def test_hello_extension_reaches_the_peer_before_its_first_stream() -> None:
    """The vm host's HELLO carries clock and seed; the agent must apply them before it accepts the
    session's first stream (a resumed guest's first command must see the right time)."""
    server, port = await _echo_server()
    events: list[str] = []
    host, agent = await _pair(
        {7: port},
        on_accept=lambda p: events.append(f"open {p}"),
        agent_on_hello=lambda extra: events.append(extra.decode()),
        host_hello=b'{"hostTime": 1}',
        host_on_hello=lambda e: events.append("host?"),
    )
    try:
        stream = await host.open(7)
        await stream.write(b"x")
        assert await stream.read() == b"x"
        assert events == ['{"hostTime": 1}', "open 7"]  # the agent sent no extension: no host call
    finally:
        await host.aclose()
        await agent.aclose()
        server.close()


async def test_a_failing_hello_extension_does_not_end_the_session() -> None:
    server, port = await _echo_server()

    def broken(extra: bytes) -> None:
        raise ValueError("not json")

    host, agent = await _pair({7: port}, agent_on_hello=broken, host_hello=b"garbage")
    try:
        stream = await host.open(7)
        await stream.write(b"y")
        assert await stream.read() == b"y"
    finally:
        await host.aclose()
        await agent.aclose()
        server.close()


async def test_the_agent_answers_a_second_hello_with_its_own() -> None:
    """A vm agent keeps its session when a new host attaches (agent.serial_readers): that host's
    HELLO voids the agent's streams, and the agent answers with a HELLO of its own, so the host
    knows the agent's side starts afresh too. A host never answers one (no HELLO ping-pong)."""
    server, port = await _echo_server()
    host, agent = await _pair({7: port})
    try:
        stream = await host.open(7)
        await host._send(Frame(FrameType.HELLO, 0, u16(VERSION)))  # what a reattaching host sends
        assert await asyncio.wait_for(stream.read(), 5) == b""
        assert stream.closed  # the agent's answer voided the host's streams as well
        await asyncio.sleep(0.1)
        fresh = await host.open(7)
        await fresh.write(b"still one session")
        assert await asyncio.wait_for(fresh.read(), 5) == b"still one session"
        await asyncio.sleep(0.1)
        assert not fresh.closed and not host.closed and not agent.closed
    finally:
        await host.aclose()
        await agent.aclose()
        server.close()


async def test_restart_voids_streams_and_delivers_a_new_hello_on_the_same_channel() -> None:
    """A vm host pausing a guest aborts its streams but keeps the channel; on resume a new HELLO
    carries fresh host facts, which the agent applies before any later stream, and the agent's
    answering HELLO does not count as a restart."""
    server, port = await _echo_server()
    facts: list[bytes] = []
    host, agent = await _pair({7: port}, agent_on_hello=facts.append, host_hello=b'{"hostTime": 1}')
    try:
        idle = await host.open(7)
        host.abort_streams("sandbox paused")
        assert idle.closed and await idle.read() == b""
        await host.restart(b'{"hostTime": 2}')
        fresh = await host.open(7)
        assert facts == [b'{"hostTime": 1}', b'{"hostTime": 2}']  # applied before the OPEN
        await fresh.write(b"after resume")
        assert await asyncio.wait_for(fresh.read(), 5) == b"after resume"
        await asyncio.sleep(0.1)  # the agent's answering HELLO has arrived by now
        assert not fresh.closed and not host.closed and not agent.closed
    finally:
        await host.aclose()
        await agent.aclose()
        server.close()

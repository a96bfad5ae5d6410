"""The agent's channel: host mux sessions bridged to local TCP ports (unix socket and serial)."""

from __future__ import annotations

import asyncio
import os
import pty
import tty
from pathlib import Path

import pytest

from aenv.agent.channel import make_local_connector, serve
from aenv.mux import MuxSession, StreamRefused, open_unix_session


async def echo_server() -> tuple[asyncio.Server, int]:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(65536):
            w.write(data.upper())
            await w.drain()
        w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def roundtrip(session: MuxSession, port: int, payload: bytes) -> bytes:
    stream = await session.open(port)
    await stream.write(payload)
    await stream.write_eof()
    out = b""
    while chunk := await stream.read():
        out += chunk
    await stream.aclose()
    return out


async def test_unix_channel_bridges_streams_and_survives_reconnects(tmp_path: Path) -> None:
    server, port = await echo_server()
    sock = str(tmp_path / "mux.sock")
    ready = asyncio.Event()
    agent = asyncio.create_task(serve(f"unix-listen:{sock}", make_local_connector(frozenset()), ready.set))
    await asyncio.wait_for(ready.wait(), 5)
    assert oct(os.stat(sock).st_mode & 0o777) == "0o600"
    for _ in range(2):  # the host drops its session and reconnects: a fresh session works
        session = await open_unix_session(sock)
        results = await asyncio.gather(*(roundtrip(session, port, f"hello {i}".encode()) for i in range(5)))
        assert results == [f"HELLO {i}".encode() for i in range(5)]
        await session.aclose()
    session = await open_unix_session(sock)
    with pytest.raises(StreamRefused):
        await session.open(1)  # nothing listens on port 1
    await session.aclose()
    agent.cancel()
    server.close()


async def test_envd_port_waits_for_a_late_listener() -> None:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    accept = make_local_connector(frozenset({port}))
    task = asyncio.create_task(accept(port))
    await asyncio.sleep(0.05)
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", port)
    _reader, writer = await asyncio.wait_for(task, 5)
    writer.close()
    server.close()


async def test_serial_channel_over_a_pty() -> None:
    """A pty is a character device like virtio-serial; raw mode makes it 8-bit clean."""
    server, port = await echo_server()
    master, slave = pty.openpty()
    tty.setraw(master)
    tty.setraw(slave)
    slave_path = os.ttyname(slave)
    agent = asyncio.create_task(serve(f"serial:{slave_path}", make_local_connector(frozenset())))
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    proto = asyncio.StreamReaderProtocol(reader)
    mfile = os.fdopen(master, "r+b", buffering=0)
    await loop.connect_read_pipe(lambda: proto, mfile)
    wtransport, wproto = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, os.fdopen(os.dup(master), "wb", buffering=0))
    writer = asyncio.StreamWriter(wtransport, wproto, None, loop)
    session = await MuxSession(reader, writer, name="host-serial").start()
    out = await asyncio.wait_for(roundtrip(session, port, b"x" * 100_000), 10)
    assert out == b"X" * 100_000
    await session.aclose()
    agent.cancel()
    server.close()
    os.close(slave)


async def test_any_port_waits_during_the_start_command_grace() -> None:
    """A template service (e.g. the code interpreter) that listens late is waited for, not refused."""
    import socket
    import time

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    accept = make_local_connector(frozenset(), any_port_until=time.monotonic() + 5)
    task = asyncio.create_task(accept(port))
    await asyncio.sleep(0.05)
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", port)
    _reader, writer = await asyncio.wait_for(task, 5)
    writer.close()
    server.close()


async def test_other_ports_fail_fast_after_the_grace() -> None:
    import socket
    import time

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    accept = make_local_connector(frozenset(), any_port_until=time.monotonic() - 1)
    with pytest.raises(ConnectionRefusedError):
        await asyncio.wait_for(accept(port), 1)


async def test_serial_readers_drop_what_a_departed_host_left_half_written() -> None:
    """Half a frame from a host that went away (paused or killed mid-write) must not be completed by
    the next host's bytes: they go to a fresh reader, and the old one's session sees EOF."""
    from aenv.agent.channel import SerialReaders
    from aenv.mux.protocol import Frame, FrameType, u16

    readers = SerialReaders()
    first = readers.current
    hello = Frame(FrameType.HELLO, 0, u16(1)).encode()
    readers.feed(Frame(FrameType.DATA, 7, b"x" * 100).encode()[:20])  # cut mid-frame
    readers.host_gone()
    readers.feed(hello)
    assert await first.read() == Frame(FrameType.DATA, 7, b"x" * 100).encode()[:20]
    assert first.at_eof()
    assert readers.current is not first
    assert await readers.current.readexactly(len(hello)) == hello
    second = readers.current
    readers.renew()  # a session that ended by itself: the next bytes start afresh too
    assert readers.current is not second


def test_host_facts_set_the_clock_and_reseed(monkeypatch: pytest.MonkeyPatch) -> None:
    import base64
    import json

    from aenv.agent import channel
    from aenv.envd import identity

    done: list[object] = []
    monkeypatch.setattr(identity, "set_wall_clock", lambda t: done.append(("clock", t)))
    monkeypatch.setattr(identity, "reseed_rng", lambda seed: done.append(("seed", seed)) or ["write"])
    channel.apply_host_facts(json.dumps({"hostTime": 1234.5, "seed": base64.b64encode(b"abc").decode()}).encode())
    assert done == [("clock", 1234.5), ("seed", b"abc")]
    done.clear()
    channel.apply_host_facts(b'{"hostTime": -1}')  # nonsense time: the clock is left alone
    assert done == []
    with pytest.raises(ValueError):
        channel.apply_host_facts(b"not json")  # the session logs it and goes on (test_session.py)

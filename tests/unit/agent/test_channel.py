"""The agent's channel: host mux sessions bridged to local TCP ports (unix socket and serial)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pty
import tty
from collections.abc import Callable
from pathlib import Path

import pytest

from aenv.agent.channel import make_local_connector, run_sessions, serve
from aenv.agent.serial_readers import FrameTracker, SerialReaders
from aenv.mux import MuxSession, StreamRefused, open_unix_session
from aenv.mux.protocol import VERSION, Frame, FrameType, starts_with_hello, u16


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
    rtransport, _ = await loop.connect_read_pipe(lambda: proto, mfile)
    wtransport, wproto = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, os.fdopen(os.dup(master), "wb", buffering=0))
    writer = asyncio.StreamWriter(wtransport, wproto, None, loop)
    try:
        session = await MuxSession(reader, writer, name="host-serial").start()
        out = await asyncio.wait_for(roundtrip(session, port, b"x" * 100_000), 10)
        assert out == b"X" * 100_000
        await session.aclose()
    finally:
        agent.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await agent
        rtransport.close()
        wtransport.close()
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


HOST_HELLO = Frame(FrameType.HELLO, 0, u16(VERSION) + b'{"hostTime": 1}').encode()


async def test_serial_readers_drop_what_a_departed_host_left_half_written() -> None:
    """Half a frame from a host that went away (paused or killed mid-write) must not be completed by
    the next host's bytes: they go to a fresh reader, and the old one's session sees EOF."""
    readers = SerialReaders()
    first = readers.current
    half = Frame(FrameType.DATA, 7, b"x" * 100).encode()[:20]
    readers.feed(half)  # cut mid-frame
    readers.host_gone()
    readers.feed(HOST_HELLO[:5])  # the next host's HELLO, split: not telling yet
    assert readers.current is first
    readers.feed(HOST_HELLO[5:])
    assert await first.read() == half
    assert first.at_eof()
    assert readers.current is not first
    assert await readers.current.readexactly(len(HOST_HELLO)) == HOST_HELLO
    second = readers.current
    readers.renew()  # a session that ended by itself: the next bytes start afresh too
    assert readers.current is not second


async def test_a_late_host_gone_notice_keeps_the_session() -> None:
    """Linux may report the previous host's departure after the next host's first bytes (the notice
    travels on another virtqueue): at a frame boundary the notice changes nothing, and mid-frame the
    bytes that follow complete the frame instead of starting a new session."""
    readers = SerialReaders()
    first = readers.current
    ping = Frame(FrameType.PING, 0, u16(1)).encode()
    readers.feed(HOST_HELLO + ping)
    readers.host_gone()  # late, at a boundary
    data = Frame(FrameType.DATA, 7, b"y" * 50).encode()
    readers.feed(data[:30])
    readers.host_gone()  # late, mid-frame
    readers.feed(data[30:])
    assert readers.current is first and not first.at_eof()
    assert await first.readexactly(len(HOST_HELLO + ping + data)) == HOST_HELLO + ping + data

    # a tail too short to tell from a HELLO (zeros) is the same host's after a short wait
    tail = Frame(FrameType.DATA, 9, b"\0" * 8).encode()
    readers.feed(tail[:-3])
    readers.host_gone()
    readers.feed(tail[-3:])
    assert first.at_eof() is False and readers.current is first
    assert await asyncio.wait_for(first.readexactly(len(tail)), 2) == tail


def test_frame_tracker_follows_boundaries_across_any_split() -> None:
    frames = b"".join(Frame(FrameType.DATA, i, b"z" * i).encode() for i in range(0, 40, 7))
    for cut in range(1, len(frames)):
        tracker = FrameTracker()
        tracker.advance(frames[:cut])
        ends = {sum(12 + i for i in range(0, k, 7)) for k in range(0, 47, 7)}
        assert tracker.at_boundary is (cut in ends), cut
        tracker.advance(frames[cut:])
        assert tracker.at_boundary


def test_starts_with_hello() -> None:
    assert starts_with_hello(HOST_HELLO) is True
    assert starts_with_hello(Frame(FrameType.HELLO, 0, u16(VERSION)).encode()) is True
    for n in (0, 5, 12, 14):
        assert starts_with_hello(HOST_HELLO[:n]) is None
    assert starts_with_hello(Frame(FrameType.PING, 0, u16(1)).encode()) is False
    assert starts_with_hello(b"\0" * 12 + b"\0\x01") is False  # length 0
    assert starts_with_hello(Frame(FrameType.HELLO, 0, u16(VERSION) + b"xy").encode()) is False
    assert starts_with_hello(Frame(FrameType.HELLO, 0, u16(VERSION + 1)).encode()) is False


class _Port:
    """A virtio-serial port as the agent sees it: host bytes arrive through SerialReaders, and what
    the agent writes reaches whichever host is attached now."""

    def __init__(self, readers: SerialReaders) -> None:
        self.readers = readers
        self.host_inbox = asyncio.StreamReader()

    def attach(self, hello_extra: bytes = b'{"hostTime": 1}') -> MuxSession:
        self.host_inbox = asyncio.StreamReader()
        return MuxSession(self.host_inbox, _Writer(self.readers.feed), name="host", hello_extra=hello_extra)  # type: ignore[arg-type]

    def agent_writer(self) -> _Writer:
        return _Writer(lambda data: self.host_inbox.feed_data(data))


class _Writer:
    def __init__(self, sink: Callable[[bytes], None]) -> None:
        self._sink = sink
        self._closed = False

    def write(self, data: bytes) -> None:
        self._sink(data)

    async def drain(self) -> None:
        return None

    def close(self) -> None:
        self._closed = True

    def is_closing(self) -> bool:
        return self._closed


async def test_a_new_host_keeps_its_streams_when_the_old_ones_departure_is_reported_late() -> None:
    """The resume race seen in CI: after ``cont`` the next host's HELLO and request reach the agent
    before the notice that the previous host left. The request must still be answered."""
    server, port = await echo_server()
    readers = SerialReaders()
    channel = _Port(readers)
    agent = asyncio.create_task(run_sessions(readers, channel.agent_writer, make_local_connector(frozenset()),  # type: ignore[arg-type]
                                             on_hello=lambda extra: None))
    try:
        old = await channel.attach().start()
        assert await asyncio.wait_for(roundtrip(old, port, b"before"), 5) == b"BEFORE"
        await old.aclose()  # paused and gone; the guest has not heard yet

        host = await channel.attach().start()
        await asyncio.wait_for(host.ping(), 5)
        stream = await asyncio.wait_for(host.open(port), 5)
        await stream.write(b"half ")
        readers.host_gone()  # the late notice
        await stream.write(b"way")
        await stream.write_eof()
        out = b""
        while chunk := await asyncio.wait_for(stream.read(), 5):
            out += chunk
        assert out == b"HALF WAY"

        # a host that leaves half a frame behind: the next one gets a fresh agent session
        readers.feed(Frame(FrameType.DATA, 1, b"q" * 40).encode()[:16])
        readers.host_gone()
        newest = await channel.attach().start()
        assert await asyncio.wait_for(roundtrip(newest, port, b"after"), 5) == b"AFTER"
    finally:
        agent.cancel()
        server.close()


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

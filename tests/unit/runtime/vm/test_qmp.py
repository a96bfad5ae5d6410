"""QMP client against a fake QEMU on a socketpair: negotiation, ids, errors, events, disconnects."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import pytest_asyncio

from aenv.runtime.vm.qmp import (
    ConnectError,
    DeserializationError,
    ExecInterruptedError,
    ExecuteError,
    FrameTooLargeError,
    QMPClient,
    Runstate,
    StateError,
)
from aenv.runtime.vm.qmp.message import decode, encode

GREETING = {"QMP": {"version": {"qemu": {"major": 7, "minor": 2, "micro": 0}}, "capabilities": []}}

Handler = Callable[["FakeQemu", dict[str, Any]], Awaitable[None]]


class FakeQemu:
    """The server half of a socketpair, speaking just enough QMP; ``handler`` answers each command."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.received: list[dict[str, Any]] = []

    async def send(self, obj: dict[str, Any] | bytes) -> None:
        self.writer.write(obj if isinstance(obj, bytes) else json.dumps(obj).encode() + b"\r\n")
        await self.writer.drain()

    async def serve(self, handler: Handler, greet: bool = True) -> None:
        try:
            if greet:
                await self.send(GREETING)
            while line := await self.reader.readline():
                msg = json.loads(line)
                self.received.append(msg)
                if msg["execute"] == "qmp_capabilities":
                    await self.send({"return": {}, "id": msg.get("id")})
                else:
                    await handler(self, msg)
        finally:  # the client left (or the test ended): this side closes too
            self.writer.close()

    def close(self) -> None:
        self.writer.close()


async def echo(server: FakeQemu, msg: dict[str, Any]) -> None:
    await server.send({"return": {"cmd": msg["execute"], "args": msg.get("arguments")}, "id": msg["id"]})


async def _pair() -> tuple[QMPClient, FakeQemu, tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    a, b = socket.socketpair()
    cr, cw = await asyncio.open_unix_connection(sock=a)
    sr, sw = await asyncio.open_unix_connection(sock=b)
    return QMPClient("test"), FakeQemu(sr, sw), (cr, cw)


@pytest_asyncio.fixture(loop_scope="function")
async def setup() -> AsyncIterator[Callable[..., Awaitable[tuple[QMPClient, FakeQemu]]]]:
    tasks: list[asyncio.Task[None]] = []
    clients: list[QMPClient] = []
    servers: list[FakeQemu] = []

    async def make(
        handler: Handler = echo, connect: bool = True, greet: bool = True
    ) -> tuple[QMPClient, FakeQemu]:
        client, server, (cr, cw) = await _pair()
        clients.append(client)
        servers.append(server)
        tasks.append(asyncio.create_task(server.serve(handler, greet)))
        if connect:
            await client.connect_streams(cr, cw, timeout=2)
        else:
            client._test_streams = (cr, cw)  # type: ignore[attr-defined]
        return client, server

    yield make
    for c in clients:
        await c.disconnect()
    for s in servers:
        s.close()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def test_message_roundtrip() -> None:
    raw = encode({"execute": "stop", "id": "1"})
    assert raw == b'{"execute":"stop","id":"1"}\n'
    assert decode(raw) == {"execute": "stop", "id": "1"}
    with pytest.raises(DeserializationError) as ei:
        decode(b"[1,2]")
    assert ei.value.raw == b"[1,2]"
    with pytest.raises(DeserializationError):
        decode(b"{nope")


async def test_negotiates_and_executes(setup: Any) -> None:
    client, server = await setup()
    assert client.runstate is Runstate.RUNNING
    assert client.greeting == GREETING
    ret = await client.execute("query-status", {"x": 1})
    assert ret == {"cmd": "query-status", "args": {"x": 1}}
    ids = [m["id"] for m in server.received]
    assert len(set(ids)) == len(ids) == 2  # qmp_capabilities + query-status, distinct ids


async def test_concurrent_replies_out_of_order(setup: Any) -> None:
    held: list[dict[str, Any]] = []

    async def reverse(server: FakeQemu, msg: dict[str, Any]) -> None:
        held.append(msg)
        if len(held) == 3:
            for m in reversed(held):
                await server.send({"return": m["arguments"]["n"], "id": m["id"]})

    client, _ = await setup(reverse)
    results = await asyncio.gather(*(client.execute("x", {"n": i}) for i in range(3)))
    assert results == [0, 1, 2]


async def test_error_reply_keeps_evidence(setup: Any) -> None:
    async def fail(server: FakeQemu, msg: dict[str, Any]) -> None:
        await server.send({"error": {"class": "GenericError", "desc": "nope"}, "id": msg["id"]})

    client, _ = await setup(fail)
    with pytest.raises(ExecuteError) as ei:
        await client.execute("migrate", {"uri": "exec:cat"})
    err = ei.value
    assert err.error_class == "GenericError" and err.desc == "nope"
    assert err.sent["execute"] == "migrate" and err.reply["error"]["desc"] == "nope"
    assert client.connected  # an error reply does not break the connection


async def test_events_reach_scoped_listeners(setup: Any) -> None:
    async def with_event(server: FakeQemu, msg: dict[str, Any]) -> None:
        await server.send({"event": "STOP", "timestamp": {"seconds": 1, "microseconds": 0}})
        await server.send({"event": "RESUME", "timestamp": {"seconds": 1, "microseconds": 0}})
        await server.send({"return": {}, "id": msg["id"]})

    client, _ = await setup(with_event)
    with client.listen("STOP") as stops, client.listen() as everything:
        await client.execute("stop")
        ev = await asyncio.wait_for(stops.get(), 1)
        assert ev["event"] == "STOP"
        assert stops.drain() == []
        assert [e["event"] for e in everything.drain()] == ["STOP", "RESUME"]
    assert client._listeners == []


async def test_unknown_id_dropped(setup: Any) -> None:
    async def stray(server: FakeQemu, msg: dict[str, Any]) -> None:
        await server.send({"return": "stray", "id": "not-ours"})
        await server.send({"return": "mine", "id": msg["id"]})

    client, _ = await setup(stray)
    assert await client.execute("x") == "mine"


async def test_disconnect_fails_pending(setup: Any) -> None:
    async def hang_up(server: FakeQemu, msg: dict[str, Any]) -> None:
        server.close()

    client, _ = await setup(hang_up)
    with pytest.raises(ExecInterruptedError):
        await asyncio.wait_for(client.execute("stop"), 2)
    assert not client.connected
    with pytest.raises(StateError):
        await client.execute("cont")
    await client.disconnect()
    await client.disconnect()  # idempotent
    assert client.runstate is Runstate.IDLE


async def test_local_disconnect_fails_pending(setup: Any) -> None:
    async def never(server: FakeQemu, msg: dict[str, Any]) -> None:
        return None

    client, _ = await setup(never)
    task = asyncio.create_task(client.execute("stop"))
    await asyncio.sleep(0.01)
    await client.disconnect()
    with pytest.raises(ExecInterruptedError):
        await task


async def test_bad_frame_fails_pending_with_cause(setup: Any) -> None:
    async def garbage(server: FakeQemu, msg: dict[str, Any]) -> None:
        await server.send(b"{this is not json}\n")

    client, _ = await setup(garbage)
    with pytest.raises(ExecInterruptedError) as ei:
        await asyncio.wait_for(client.execute("x"), 2)
    assert isinstance(ei.value.__cause__, DeserializationError)


async def test_frame_limit() -> None:
    a, b = socket.socketpair()
    cr, cw = await asyncio.open_unix_connection(sock=a, limit=1024)
    _, sw = await asyncio.open_unix_connection(sock=b)
    client = QMPClient("small", frame_limit=4096)
    sw.write(json.dumps({"QMP": {"pad": "x" * 10000}}).encode() + b"\n")
    await sw.drain()
    with pytest.raises(ConnectError) as ei:
        await client.connect_streams(cr, cw, timeout=2)
    assert isinstance(ei.value.__cause__, FrameTooLargeError)
    assert client.runstate is Runstate.IDLE
    sw.close()
    cw.close()


async def test_bad_greeting_rolls_back(setup: Any) -> None:
    async def noop(server: FakeQemu, msg: dict[str, Any]) -> None:
        return None

    client, server = await setup(noop, connect=False, greet=False)
    await server.send({"hello": 1})
    cr, cw = client._test_streams
    with pytest.raises(ConnectError):
        await client.connect_streams(cr, cw, timeout=2)
    assert client.runstate is Runstate.IDLE
    cw.close()


async def test_connect_timeout_when_socket_missing(tmp_path: Any) -> None:
    client = QMPClient()
    with pytest.raises(ConnectError):
        await client.connect(tmp_path / "nope.sock", timeout=0.1)
    assert client.runstate is Runstate.IDLE


async def test_connect_over_unix_path(tmp_path: Any) -> None:
    path = str(tmp_path / "q.sock")

    async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await FakeQemu(r, w).serve(echo)

    async def start_late() -> asyncio.AbstractServer:
        await asyncio.sleep(0.05)  # client must retry until the socket exists
        return await asyncio.start_unix_server(on_conn, path)

    srv_task = asyncio.create_task(start_late())
    async with QMPClient() as client:
        await client.connect(path, timeout=2)
        assert (await client.execute("query-status"))["cmd"] == "query-status"
    srv = await srv_task
    srv.close()
    await srv.wait_closed()

"""The WebSocket relay (websocket.py, tied in by SandboxProxy), driven as the front server drives it (ASGI
messages in, ASGI messages out), against a real WebSocket server in the "sandbox" (the ``websockets``
package, strict about what a client sends) or a scripted raw one for what a well-behaved server never
does: every close from either side, pings, fragments, refusals, broken handshakes, and no stream or task
left behind by any of them.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import pytest
import pytest_asyncio
from websockets.asyncio.server import ServerConnection, serve
from websockets.typing import Subprotocol

from aenv.api.proxy import SandboxProxy, websocket, wsframe
from bench.ws_echo_server import Echo
from tests.unit.api.proxy.helpers import (
    Exchange,
    FakeOrchestrator,
    Rig,
    WsExchange,
    read_request,
    relay_tasks,
    respond,
)

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


async def accept_upgrade(r: asyncio.StreamReader, w: asyncio.StreamWriter, then: bytes = b"") -> None:
    """A scripted sandbox server's side of the handshake (101 with the right accept), then ``then``."""
    _, headers, _ = await read_request(r) or (b"", {}, b"")
    accept = base64.b64encode(hashlib.sha1(headers[b"sec-websocket-key"] + GUID).digest())
    w.write(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n"
            b"sec-websocket-accept: " + accept + b"\r\n\r\n" + then)  # fmt: skip
    await w.drain()


class _AnyString:
    def __eq__(self, other: object) -> bool:
        return isinstance(other, str)


ANY_STRING = _AnyString()


class Sandbox(Echo):
    """The echo server of the WebSocket tests and bench (bench/ws_echo_server.py) in the "sandbox"."""

    @property
    def closes(self) -> list[tuple[int | None, str | None]]:
        return [tuple(c) for c in self.stats["closes"]]  # type: ignore[misc]


Started = tuple[SandboxProxy, FakeOrchestrator, Sandbox]


def _v2(connection: ServerConnection, offered: Sequence[Subprotocol]) -> Subprotocol | None:
    return Subprotocol("v2") if "v2" in offered else None


@pytest_asyncio.fixture(loop_scope="function")
async def ws_rig(rig: Rig) -> AsyncIterator[Callable[[], Awaitable[Started]]]:
    servers = []

    async def make() -> Started:
        sandbox = Sandbox()
        server = await serve(sandbox.handler, "127.0.0.1", 0, max_size=None, select_subprotocol=_v2)
        servers.append(server)
        proxy, orch, _ = await rig(upstream_port=server.sockets[0].getsockname()[1])
        return proxy, orch, sandbox

    yield make
    for server in servers:
        server.close()
        await server.wait_closed()


async def assert_nothing_left(proxy: SandboxProxy, orch: FakeOrchestrator, ex: WsExchange) -> None:
    await ex.done()
    assert not proxy.upgraded and not orch.host._streams
    assert relay_tasks() == []


async def test_echo_text_binary_and_a_large_message(ws_rig: Any) -> None:
    proxy, orch, sandbox = await ws_rig()
    ex = WsExchange(proxy, headers=[(b"sec-websocket-protocol", b"v1, v2")])
    accept = await ex.next()
    assert accept["type"] == "websocket.accept" and accept["subprotocol"] == "v2"
    ex.text("hello")
    assert await ex.next() == {"type": "websocket.send", "text": "hello"}
    ex.binary(b"\x00\xff")
    assert await ex.next() == {"type": "websocket.send", "bytes": b"\x00\xff"}
    big = bytes(range(256)) * (6 * 4096)  # 6 MiB
    ex.binary(big)
    assert (await ex.next())["bytes"] == big
    ex.disconnect(1000)
    await assert_nothing_left(proxy, orch, ex)
    await asyncio.wait_for(sandbox.ended.wait(), 5)
    assert sandbox.closes == [(1000, "")]


async def test_the_clients_close_code_and_reason_reach_the_sandbox(ws_rig: Any) -> None:
    proxy, orch, sandbox = await ws_rig()
    ex = WsExchange(proxy)
    await ex.next()
    ex.disconnect(4000, "episode over")
    await assert_nothing_left(proxy, orch, ex)
    await asyncio.wait_for(sandbox.ended.wait(), 5)
    assert sandbox.closes == [(4000, "episode over")]
    assert ex.sent[1:] == []  # nothing more was sent to a client that left


async def test_a_client_that_drops_its_connection_closes_the_sandbox_side(ws_rig: Any) -> None:
    proxy, orch, sandbox = await ws_rig()
    ex = WsExchange(proxy)
    await ex.next()
    ex.disconnect(1005)  # uvicorn's word for a connection lost without a close frame
    await assert_nothing_left(proxy, orch, ex)
    await asyncio.wait_for(sandbox.ended.wait(), 5)
    assert sandbox.closes == [(1005, "")]


async def test_the_sandboxs_close_reaches_the_client(ws_rig: Any) -> None:
    proxy, orch, sandbox = await ws_rig()
    ex = WsExchange(proxy)
    await ex.next()
    ex.text("close-me")
    assert await ex.next() == {"type": "websocket.close", "code": 4001, "reason": "bye"}
    await assert_nothing_left(proxy, orch, ex)
    await asyncio.wait_for(sandbox.ended.wait(), 5)
    assert sandbox.closes == [(4001, "bye")]  # and its close handshake completed


async def test_the_sandboxs_ping_is_answered_and_fragments_arrive_as_one_message(ws_rig: Any) -> None:
    proxy, orch, sandbox = await ws_rig()
    ex = WsExchange(proxy)
    await ex.next()
    ex.text("ping-me")
    assert await ex.next() == {"type": "websocket.send", "text": "ponged"}  # after the pong came
    ex.text("fragments")
    assert await ex.next() == {"type": "websocket.send", "text": "abcdef"}
    ex.disconnect()
    await assert_nothing_left(proxy, orch, ex)


@pytest.mark.parametrize("how", ["drop", "half-close"])
async def test_a_sandbox_side_ending_without_a_close_drops_the_client(ws_rig: Any, how: str) -> None:
    proxy, orch, sandbox = await ws_rig()
    ex = WsExchange(proxy)
    await ex.next()
    ex.text(how)
    await assert_nothing_left(proxy, orch, ex)  # returned without a close: the server drops the client (1006)
    assert [m["type"] for m in ex.sent] == ["websocket.accept"]
    await asyncio.wait_for(sandbox.ended.wait(), 5)


async def test_a_sandbox_that_does_not_answer_the_close_is_cut_off(rig: Rig, monkeypatch: Any) -> None:
    monkeypatch.setattr(websocket, "CLOSE_TIMEOUT", 0.2)
    upstream_closed = asyncio.Event()

    async def deaf(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await accept_upgrade(r, w)
        while await r.read(65536):  # reads the close frame, never answers it
            pass
        upstream_closed.set()

    proxy, orch, _ = await rig(deaf)
    ex = WsExchange(proxy)
    await ex.next()
    ex.disconnect(1000)
    await assert_nothing_left(proxy, orch, ex)
    await asyncio.wait_for(upstream_closed.wait(), 5)


async def test_refusals_are_http_answers(rig: Rig) -> None:
    proxy, orch, _ = await rig(respond(b"HTTP/1.1 404 Not Found\r\ncontent-length: 4\r\nx-why: route\r\n\r\nnope"))
    ex = WsExchange(proxy)
    start = await ex.next()
    assert (start["type"], start["status"], dict(start["headers"])[b"x-why"]) == (
        "websocket.http.response.start", 404, b"route")
    body = b"".join(m.get("body", b"") for m in ex.sent[1:])
    await ex.done()
    assert body == b"nope" and ex.sent[-1]["more_body"] is False
    assert not proxy.upgraded and not orch.host._streams

    no_denials = await WsExchange(proxy, denial=False).done()  # a server without the denial extension
    assert no_denials.sent == [{"type": "websocket.close", "code": 1008}]

    for kwargs, status, words in [
        ({"sandbox": "gone"}, 502, b"was not found"),
        ({"port": 9}, 502, b"port is not open"),
        ({"port": 49983, "path": "/init"}, 403, b"internal envd route"),
        ({"port": 70000}, 400, b"invalid E2b-Sandbox-Port"),
    ]:
        ex = await WsExchange(proxy, **kwargs).done()
        assert ex.sent[0]["status"] == status and words in ex.sent[1]["body"], kwargs
        assert relay_tasks() == []


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n"
        b"sec-websocket-accept: wrong\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\nconnection: upgrade\r\n\r\n",
        b"garbage\r\n\r\n",
        b"",
    ],
)
async def test_a_broken_handshake_is_a_502(rig: Rig, answer: bytes) -> None:
    proxy, orch, _ = await rig(respond(answer, requests=1))
    ex = await WsExchange(proxy).done()
    assert ex.sent[0]["status"] == 502 and b"unreachable" in ex.sent[1]["body"]
    assert not proxy.upgraded and not orch.host._streams


async def test_a_client_that_leaves_during_the_handshake_ends_the_relay(rig: Rig) -> None:
    seen = asyncio.Event()
    upstream_closed = asyncio.Event()

    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        seen.set()
        await r.read()  # never answers; returns when the proxy closes
        upstream_closed.set()

    proxy, orch, _ = await rig(silent)
    ex = WsExchange(proxy)
    await asyncio.wait_for(seen.wait(), 5)
    ex.disconnect(1006)
    await assert_nothing_left(proxy, orch, ex)
    assert ex.sent == []
    await asyncio.wait_for(upstream_closed.wait(), 5)


async def test_a_sandbox_breaking_the_protocol_is_closed_on_both_sides(rig: Rig) -> None:
    async def rsv(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await accept_upgrade(r, w, bytes([0x81, 0x02]) + b"ok" + bytes([0xC1, 0x01]) + b"x")
        head = await r.readexactly(2)
        assert head[0] == 0x88 and head[1] & 0x80  # a close frame, masked as a client's must be
        await r.read()

    proxy, orch, _ = await rig(rsv)
    ex = WsExchange(proxy)
    assert (await ex.next())["type"] == "websocket.accept"
    assert await ex.next() == {"type": "websocket.send", "text": "ok"}
    close = await ex.next()
    assert (close["type"], close["code"]) == ("websocket.close", 1002)
    await assert_nothing_left(proxy, orch, ex)


async def test_shutdown_closes_live_websocket_streams(ws_rig: Any) -> None:
    proxy, orch, sandbox = await ws_rig()
    ex = WsExchange(proxy)
    await ex.next()
    assert len(proxy.upgraded) == 1
    await proxy.aclose()
    await assert_nothing_left(proxy, orch, ex)
    await asyncio.wait_for(sandbox.ended.wait(), 5)


async def test_other_upgrades_are_501_and_h2c_is_ignored(rig: Rig) -> None:
    seen: list[dict[bytes, bytes]] = []

    async def plain(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while (req := await read_request(r)) is not None:
            seen.append(req[1])
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await w.drain()

    proxy, orch, _ = await rig(plain)
    ex = Exchange(proxy, headers=[(b"connection", b"keep-alive, Upgrade"), (b"upgrade", b"tcp, foo/2")])
    await ex.done()
    assert ex.status == 501 and ex.headers[b"connection"] == b"close"
    assert json.loads(ex.content) == {"code": 501, "message": ANY_STRING} and b"tcp, foo/2" in ex.content
    assert orch.opened == 0

    ex = Exchange(proxy, headers=[(b"connection", b"Upgrade, HTTP2-Settings"), (b"upgrade", b"h2c"),
                                  (b"http2-settings", b"AAMAAABkAAQAoAAAAAIAAAAA")])  # fmt: skip
    ex.body(b"")
    await ex.done()
    assert (ex.status, ex.content) == (200, b"ok")
    assert b"upgrade" not in seen[0] and b"connection" not in seen[0]

    ex = Exchange(proxy, headers=[(b"upgrade", b"websocket")])  # no Connection: upgrade, no upgrade asked
    ex.body(b"")
    await ex.done()
    assert ex.status == 200


async def test_a_ping_during_a_large_upload_does_not_stop_the_relay(rig: Rig) -> None:
    """The sandbox pings and talks while not reading a large message of the client's: its frames still
    reach the client, and the pong follows the message on the wire (never inside it)."""
    go = asyncio.Event()
    upstream_frames: list[wsframe.Event] = []

    async def busy(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await accept_upgrade(r, w)
        started = await r.readexactly(2)  # the large message is on its way
        w.write(bytes([0x89, 0x02]) + b"p1" + bytes([0x81, 0x0A]) + b"after-ping")
        await w.drain()
        await go.wait()  # reads nothing more until the client has heard it
        decoder = wsframe.FrameDecoder(1 << 30)
        upstream_frames.extend(decoder.feed(started))
        while len(upstream_frames) < 2 and (data := await r.read(1 << 20)):
            upstream_frames.extend(decoder.feed(data))

    proxy, orch, _ = await rig(busy)
    ex = WsExchange(proxy)
    await ex.next()
    big = b"z" * (8 << 20)  # far more than the mux window and the socket buffers hold
    ex.binary(big)
    assert await ex.next() == {"type": "websocket.send", "text": "after-ping"}
    go.set()
    async with asyncio.timeout(10):
        while len(upstream_frames) < 2:
            await asyncio.sleep(0.01)
    assert upstream_frames == [wsframe.Message(big), wsframe.Pong(b"p1")]
    ex.disconnect()
    await assert_nothing_left(proxy, orch, ex)

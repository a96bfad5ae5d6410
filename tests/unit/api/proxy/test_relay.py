"""The relay of one exchange (relay.py, tied together in SandboxProxy): every response framing, request
bodies streaming up, keep-alive reuse, disconnects and a sandbox side that breaks off, against scripted
upstream servers behind a real mux (helpers.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from aenv.api.proxy.codec import MAX_HEAD
from tests.unit.api.proxy.helpers import Exchange, Handler, Rig, read_request, respond


async def test_content_length_and_keep_alive_reuse(rig: Any) -> None:
    proxy, orch, upstream = await rig(respond(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nx-up: 1\r\n\r\nhello"))
    for _ in range(3):
        ex = Exchange(proxy)
        ex.body(b"")
        await ex.done()
        assert (ex.status, ex.content, ex.complete) == (200, b"hello", True)
        assert ex.headers[b"x-up"] == b"1"
    assert orch.opened == 1 and upstream.connections == 1


async def test_streamed_chunked_response_arrives_piece_by_piece(rig: Any) -> None:
    release = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await w.drain()
        await release.wait()
        w.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await w.drain()
        await read_request(r)

    proxy, orch, _ = await rig(handler)
    ex = Exchange(proxy, "POST")
    ex.body(b"")
    await ex.wait_for(lambda: ex.content == b"first")
    assert not ex.complete and b"transfer-encoding" not in ex.headers
    release.set()
    await ex.done()
    assert ex.content == b"firstsecond" and ex.complete


async def test_close_delimited_http10_response_is_not_reused(rig: Any) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.0 200 OK\r\nServer: SimpleHTTP\r\n\r\n" + b"x" * 200_000)
        await w.drain()

    proxy, orch, _ = await rig(handler)
    for _ in range(2):
        ex = Exchange(proxy)
        ex.body(b"")
        await ex.done()
        assert ex.content == b"x" * 200_000 and ex.complete
    assert orch.opened == 2


async def test_informational_head_and_204(rig: Any) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while req := await read_request(r):
            if req[0].startswith(b"HEAD"):
                w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 99\r\n\r\n")
            elif req[0].startswith(b"DELETE"):
                w.write(b"HTTP/1.1 204 No Content\r\ncontent-length: 3\r\n\r\n")
            else:
                w.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok")
            await w.drain()

    proxy, orch, _ = await rig(handler)
    ex = Exchange(proxy, "HEAD")
    ex.body(b"")
    await ex.done()
    assert (ex.status, ex.headers[b"content-length"], ex.content, ex.complete) == (200, b"99", b"", True)
    ex = Exchange(proxy, "DELETE")
    ex.body(b"")
    await ex.done()
    assert (ex.status, ex.content, ex.complete) == (204, b"", True) and b"content-length" not in ex.headers
    ex = Exchange(proxy, "PUT", headers=[(b"content-length", b"3"), (b"expect", b"100-continue")])
    ex.body(b"abc")
    await ex.done()
    assert (ex.status, ex.content) == (201, b"ok")
    assert orch.opened == 1


async def test_request_bodies_stream_up(rig: Any) -> None:
    seen: list[tuple[bytes, dict[bytes, bytes], bytes]] = []

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while req := await read_request(r):
            seen.append(req)
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(req[2]), req[2]))
            await w.drain()

    proxy, orch, _ = await rig(handler)
    big = bytes(range(256)) * 4096  # 1 MiB: more than the mux window, so flow control is exercised
    ex = Exchange(proxy, "POST", headers=[(b"content-length", str(len(big)).encode())])
    for i in range(0, len(big), 65536):
        ex.body(big[i : i + 65536], more=i + 65536 < len(big))
    await ex.done(20)
    assert ex.content == big
    ex = Exchange(proxy, "POST", headers=[(b"transfer-encoding", b"chunked")])
    ex.body(b"one ", more=True)
    await asyncio.sleep(0.05)
    ex.body(b"two", more=True)
    ex.body(b"", more=False)
    await ex.done()
    assert ex.content == b"one two"
    assert seen[1][1][b"transfer-encoding"] == b"chunked" and seen[1][0] == b"POST /x?q=1 HTTP/1.1"
    assert orch.opened == 1


async def test_client_disconnect_closes_upstream_only(rig: Any) -> None:
    upstream_gone: list[asyncio.Event] = [asyncio.Event(), asyncio.Event()]

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        n = len([e for e in upstream_gone if e.is_set()])
        await read_request(r)
        if n == 0:  # a stream that has started, then goes quiet
            w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
            await w.drain()
        await r.read()  # EOF: the proxy dropped the connection
        upstream_gone[n].set()

    proxy, orch, _ = await rig(handler)
    ex = Exchange(proxy, "POST")
    ex.body(b"")
    await ex.wait_for(lambda: ex.content == b"abc")
    ex.disconnect()
    await ex.done()
    assert not ex.complete
    async with asyncio.timeout(5):
        await upstream_gone[0].wait()
    # Disconnect while waiting for the response head.
    ex = Exchange(proxy, "POST")
    ex.body(b"")
    await asyncio.sleep(0.05)
    ex.disconnect()
    await ex.done()
    assert ex.sent == []
    async with asyncio.timeout(5):
        await upstream_gone[1].wait()
    assert orch.opened == 2


async def test_truncated_body_leaves_response_incomplete(rig: Any) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        await w.drain()

    proxy, orch, _ = await rig(handler)
    ex = Exchange(proxy)
    ex.body(b"")
    await ex.done()
    assert ex.status == 200 and ex.content == b"abc" and not ex.complete


# ---- added with the split: limits, framings that end reuse, the retry of a stream that died idle ----


async def test_response_head_over_the_limit_is_502(rig: Rig) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * (MAX_HEAD + 1))  # no end of head, and it stays open
        await w.drain()
        await r.read()

    proxy, orch, _ = await rig(handler)
    ex = Exchange(proxy)
    ex.body(b"")
    await ex.done()
    assert ex.status == 502 and b"RemoteProtocolError" in ex.content


async def test_upgrade_and_bad_content_length_are_502(rig: Rig) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        req = await read_request(r)
        assert req is not None
        if req[0].startswith(b"GET"):
            w.write(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n\r\n")
        else:
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1e3\r\n\r\nok")
        await w.drain()
        await r.read()

    proxy, orch, _ = await rig(handler)
    for method in ("GET", "POST"):
        ex = Exchange(proxy, method)
        ex.body(b"")
        await ex.done()
        assert ex.status == 502 and b"RemoteProtocolError" in ex.content, method


async def test_responses_that_end_reuse(rig: Rig) -> None:
    # Bytes beyond the Content-Length, trailing bytes after a chunked body, Connection: close: each
    # response is relayed whole, and the next request gets a fresh stream.
    responses = [
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokEXTRA",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\nEXTRA",
        b"HTTP/1.1 200 OK\r\nConnection: Keep-Alive, Close\r\ncontent-length: 2\r\n\r\nok",
    ]

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while await read_request(r) is not None:
            w.write(responses.pop(0) if responses else b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await w.drain()

    proxy, orch, upstream = await rig(handler)
    for n in range(1, 5):
        ex = Exchange(proxy)
        ex.body(b"")
        await ex.done()
        assert (ex.status, ex.content, ex.complete) == (200, b"ok", True)
        assert b"connection" not in ex.headers
        assert orch.opened == n
    ex = Exchange(proxy)  # the fourth response was clean: its stream carries the fifth request
    ex.body(b"")
    await ex.done()
    assert orch.opened == 4 and upstream.connections == 4


def _dies_on_second_request() -> Handler:
    """The first connection answers one request, then reads the next and hangs up without a response;
    later connections answer every request."""
    connections = 0

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        first, answered = connections == 1, 0
        while await read_request(r) is not None:
            if first and answered:
                return
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await w.drain()
            answered += 1

    return handler


async def test_reused_stream_that_dies_unanswered_is_retried_on_a_fresh_one(rig: Rig) -> None:
    proxy, orch, upstream = await rig(_dies_on_second_request())
    for _ in range(2):
        ex = Exchange(proxy, "PUT", headers=[(b"content-length", b"3")])
        ex.body(b"abc")
        await ex.done()
        assert (ex.status, ex.content, ex.complete) == (200, b"ok", True)
    assert orch.opened == 2 and upstream.connections == 2


async def test_reused_stream_that_dies_under_a_streaming_body_is_not_retried(rig: Rig) -> None:
    # A chunked request body has gone upstream as it came: it is not in hand to send again.
    proxy, orch, upstream = await rig(_dies_on_second_request())
    ex = Exchange(proxy)
    ex.body(b"")
    await ex.done()
    ex = Exchange(proxy, "POST", headers=[(b"transfer-encoding", b"chunked")])
    ex.body(b"abc")
    await ex.done()
    assert ex.status == 502 and b"RemoteProtocolError" in ex.content
    assert orch.opened == 1 and upstream.connections == 1


@pytest.mark.parametrize("framing", [b"", b"transfer-encoding: chunked\r\n"], ids=["until-eof", "chunked"])
async def test_event_streams_pass_event_by_event_however_long_they_pause(rig: Rig, framing: bytes) -> None:
    """SSE: each event reaches the client before the next one exists, and a quiet stream is not cut (the
    relay has no idle timeout of its own)."""
    gates = [asyncio.Event() for _ in range(3)]

    async def sse(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n" + framing
                + b"\r\n")  # fmt: skip
        for i, gate in enumerate(gates):
            await gate.wait()
            event = b"data: %d\n\n" % i
            w.write(b"%x\r\n%s\r\n" % (len(event), event) if framing else event)
            await w.drain()
        w.write(b"0\r\n\r\n" if framing else b"")
        await w.drain()
        if not framing:
            w.close()

    proxy, _, _ = await rig(sse)
    ex = Exchange(proxy)
    ex.body(b"")
    await ex.wait_for(lambda: bool(ex.sent))
    assert ex.headers[b"content-type"] == b"text/event-stream"
    for i, gate in enumerate(gates):
        await asyncio.sleep(0.2)  # a quiet stream stays open
        assert not ex.complete
        gate.set()
        want = b"".join(b"data: %d\n\n" % k for k in range(i + 1))
        await ex.wait_for(lambda want=want: ex.content == want)  # type: ignore[misc]
    await ex.done()
    assert ex.complete

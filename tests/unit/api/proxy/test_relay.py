"""The sandbox proxy's HTTP/1.1 relay, against scripted upstream servers behind a real mux over a socketpair.

The proxy is driven as a bare ASGI app (scope, receive, send), so every message it sends, and when, is
visible: streaming without buffering, keep-alive reuse, every response framing, disconnects, 502s.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from aenv.api.proxy import ChunkedDecoder, SandboxProxy, UpstreamError, parse_response_head, request_head
from aenv.errors import PortNotOpen, SandboxNotFound
from aenv.mux import MuxSession, StreamRefused

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(r: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes], bytes] | None:
    """One request off an upstream connection: (request line, headers, body), None at EOF."""
    try:
        head = await r.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    line, *rest = head[:-4].split(b"\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(b":") for h in rest)}
    body = b""
    if headers.get(b"transfer-encoding") == b"chunked":
        while True:
            size = int((await r.readuntil(b"\r\n"))[:-2], 16)
            chunk = await r.readexactly(size + 2)
            if not size:
                break
            body += chunk[:-2]
    elif b"content-length" in headers:
        body = await r.readexactly(int(headers[b"content-length"]))
    return line, headers, body


class Upstream:
    """A TCP server inside the "sandbox": runs ``handler`` per connection and records what it saw."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.closed = asyncio.Event()  # set when a connection's client side went away
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> int:
        async def run(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handler(r, w)
            except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
                pass
            finally:
                w.close()

        self.server = await asyncio.start_server(run, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])


class FakeOrchestrator:
    def __init__(self, host: MuxSession) -> None:
        self.host = host
        self.opened = 0

    async def open_stream(self, sandbox_id: str, port: int) -> Any:
        if sandbox_id != "sbx":
            raise SandboxNotFound(sandbox_id)
        self.opened += 1
        try:
            return await self.host.open(port)
        except StreamRefused as exc:
            raise PortNotOpen(f"nothing on {port}") from exc

    def find_by_file_signature(self, *args: Any) -> str | None:
        return None


class Exchange:
    """One request through the proxy: feed body messages and a disconnect; see what was sent, as sent."""

    def __init__(self, proxy: SandboxProxy, method: str = "GET", path: str = "/x", port: int = 8080,
                 headers: list[tuple[bytes, bytes]] | None = None, sandbox: str = "sbx") -> None:
        self.scope = {
            "type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b"q=1",
            "headers": [(b"host", b"127.0.0.1:8000"), (b"e2b-sandbox-id", sandbox.encode()),
                        (b"e2b-sandbox-port", str(port).encode()), *(headers or [])],
        }
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.sent: list[dict[str, Any]] = []
        self.new_message = asyncio.Event()
        self.task = asyncio.create_task(proxy(self.scope, self.inbox.get, self._send))

    async def _send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        self.new_message.set()

    def body(self, data: bytes, more: bool = False) -> None:
        self.inbox.put_nowait({"type": "http.request", "body": data, "more_body": more})

    def disconnect(self) -> None:
        self.inbox.put_nowait({"type": "http.disconnect"})

    async def wait_for(self, pred: Callable[[], bool], timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            while not pred():
                self.new_message.clear()
                await self.new_message.wait()

    @property
    def status(self) -> int:
        return int(self.sent[0]["status"])

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(self.sent[0]["headers"])

    @property
    def content(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent[1:])

    @property
    def complete(self) -> bool:
        return bool(self.sent) and self.sent[-1]["type"] == "http.response.body" and not self.sent[-1]["more_body"]

    async def done(self, timeout: float = 5.0) -> Exchange:
        async with asyncio.timeout(timeout):
            await self.task
        return self


@pytest.fixture
async def rig() -> AsyncIterator[Callable[..., Awaitable[tuple[SandboxProxy, FakeOrchestrator, Upstream]]]]:
    cleanups: list[Callable[[], Awaitable[None]]] = []

    async def make(handler: Handler, port: int = 8080) -> tuple[SandboxProxy, FakeOrchestrator, Upstream]:
        upstream = Upstream(handler)
        real_port = await upstream.start()

        async def accept(p: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            if p != port:
                raise ConnectionRefusedError(f"nothing on {p}")
            return await asyncio.open_connection("127.0.0.1", real_port)

        a, b = socket.socketpair()
        hr, hw = await asyncio.open_unix_connection(sock=a)
        ar, aw = await asyncio.open_unix_connection(sock=b)
        agent = await MuxSession(ar, aw, accept=accept, name="agent").start()
        host = await MuxSession(hr, hw, name="host").start()
        orch = FakeOrchestrator(host)

        async def app(scope: Any, receive: Any, send: Any) -> None:
            raise AssertionError("control plane reached")

        proxy = SandboxProxy(app, lambda: orch)  # type: ignore[arg-type, return-value]

        async def cleanup() -> None:
            await proxy.aclose()
            await host.aclose()
            await agent.aclose()
            assert upstream.server is not None
            upstream.server.close()

        cleanups.append(cleanup)
        return proxy, orch, upstream

    yield make
    for c in cleanups:
        await c()


def respond(raw: bytes, requests: int = 1000) -> Handler:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        for _ in range(requests):
            if await read_request(r) is None:
                return
            w.write(raw)
            await w.drain()

    return handler


# ---- pure pieces ------------------------------------------------------------------------------------


def test_request_head_drops_hop_by_hop_and_keeps_framing() -> None:
    scope = {
        "method": "POST", "path": "/a b", "raw_path": b"/a%20b", "query_string": b"x=1&y=2",
        "headers": [(b"host", b"h"), (b"connection", b"keep-alive"), (b"expect", b"100-continue"),
                    (b"te", b"trailers"), (b"content-length", b"5"), (b"x-access-token", b"t")],
    }
    head, framing = request_head(scope)
    assert framing == "length"
    assert head == b"POST /a%20b?x=1&y=2 HTTP/1.1\r\nhost: h\r\nx-access-token: t\r\ncontent-length: 5\r\n\r\n"
    scope["headers"] = [(b"transfer-encoding", b"chunked"), (b"content-length", b"5")]
    head, framing = request_head(scope)
    assert framing == "chunked"
    assert head.endswith(b"transfer-encoding: chunked\r\nhost: sandbox\r\n\r\n") and b"content-length" not in head
    scope["headers"] = [(b"host", b"h"), (b"content-length", b"0")]
    head, framing = request_head(scope)
    assert framing is None and head.endswith(b"content-length: 0\r\n\r\n")


def test_parse_response_head() -> None:
    status, http11, headers, framing = parse_response_head(
        b"HTTP/1.1 200 OK\r\nContent-Type: a/b\r\nConnection: close\r\nTransfer-Encoding: chunked\r\nX-A:  1 \r\n"
    )
    assert (status, http11) == (200, True)
    assert headers == [(b"content-type", b"a/b"), (b"x-a", b"1")]
    assert framing == {b"connection": b"close", b"transfer-encoding": b"chunked"}
    assert parse_response_head(b"HTTP/1.0 404 Not Found\n")[:2] == (404, False)
    for bad in (b"SSH-2.0-OpenSSH", b"HTTP/1.1 abc", b"HTTP/1.1 200 OK\r\nno colon",
                b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2"):
        with pytest.raises(UpstreamError):
            parse_response_head(bad)


def test_chunked_decoder_any_split() -> None:
    wire = b"5;ext=1\r\nhello\r\n1\r\n \r\nA\r\n0123456789\r\n0\r\nTrailer: x\r\n\r\n"
    for step in (1, 2, 3, 7, len(wire)):
        dec, buf, out = ChunkedDecoder(), bytearray(), b""
        for i in range(0, len(wire), step):
            buf += wire[i : i + step]
            out += dec.feed(buf)
        assert dec.done and out == b"hello 0123456789" and not buf
    with pytest.raises(UpstreamError):
        ChunkedDecoder().feed(bytearray(b"zz\r\n"))


# ---- through the mux --------------------------------------------------------------------------------


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


async def test_stale_keep_alive_stream_is_replaced(rig: Any) -> None:
    # The upstream claims keep-alive, then hangs up after each response: the next request must still work.
    proxy, orch, upstream = await rig(respond(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", requests=1))
    for _ in range(3):
        ex = Exchange(proxy)
        ex.body(b"")
        await ex.done()
        assert (ex.status, ex.content) == (200, b"ok")
        await asyncio.sleep(0.05)
    assert upstream.connections == 3


async def test_errors_become_502(rig: Any) -> None:
    proxy, orch, _ = await rig(respond(b"SSH-2.0-OpenSSH_9.2\r\n\r\n"))
    ex = Exchange(proxy)
    ex.body(b"")
    await ex.done()
    assert ex.status == 502 and b"unreachable" in ex.content
    ex = Exchange(proxy, sandbox="nosuch")
    ex.body(b"")
    await ex.done()
    assert ex.status == 502 and b"The sandbox was not found" in ex.content
    ex = Exchange(proxy, port=9)
    ex.body(b"")
    await ex.done()
    assert ex.status == 502 and b"port is not open" in ex.content
    ex = Exchange(proxy, path="/init", port=49983)
    ex.body(b"")
    await ex.done()
    assert ex.status == 403


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


async def test_prewarmed_stream_serves_the_first_request(rig: Any) -> None:
    proxy, orch, upstream = await rig(respond(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"), port=49983)
    proxy.prewarm("sbx")
    # The request arrives while the prewarm is still opening: it waits for that stream, opens none.
    ex = Exchange(proxy, port=49983)
    ex.body(b"")
    await ex.done()
    assert (ex.status, ex.content) == (200, b"ok")
    assert orch.opened == 1 and upstream.connections == 1
    proxy.prewarm("nosuch")  # a failed prewarm is silent
    await asyncio.sleep(0.05)

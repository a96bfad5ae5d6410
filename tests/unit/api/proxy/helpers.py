"""The rig the proxy tests drive: scripted upstream servers inside a "sandbox" reached through a real mux
over a socketpair, and the proxy as a bare ASGI app (scope, receive, send), so that every message it
sends, and when, is visible.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aenv.api.proxy import SandboxProxy
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
        from aenv.core.table import SandboxTable

        self.host = host
        self.opened = 0
        self.table = SandboxTable()  # the proxy reads a sandbox's inbound settings (traffic token, Host mask)

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


Rig = Callable[..., Awaitable[tuple[SandboxProxy, FakeOrchestrator, Upstream]]]


def respond(raw: bytes, requests: int = 1000) -> Handler:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        for _ in range(requests):
            if await read_request(r) is None:
                return
            w.write(raw)
            await w.drain()

    return handler


class WsExchange:
    """One WebSocket connection through the proxy, as the front server would drive it: the client's
    messages and disconnect go in, and every message the proxy sends is kept."""

    def __init__(self, proxy: SandboxProxy, path: str = "/ws", port: int = 8080, sandbox: str = "sbx",
                 headers: list[tuple[bytes, bytes]] | None = None, denial: bool = True) -> None:
        self.scope: dict[str, Any] = {
            "type": "websocket", "path": path, "raw_path": path.encode(), "query_string": b"a=1",
            "headers": [(b"host", b"127.0.0.1:8000"), (b"e2b-sandbox-id", sandbox.encode()),
                        (b"e2b-sandbox-port", str(port).encode()), *(headers or [])],
            "subprotocols": [], "extensions": {"websocket.http.response": {}} if denial else {},
        }
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.inbox.put_nowait({"type": "websocket.connect"})
        self.sent: list[dict[str, Any]] = []
        self._seen = 0
        self.new_message = asyncio.Event()
        self.task = asyncio.create_task(proxy(self.scope, self.inbox.get, self._send))

    async def _send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        self.new_message.set()

    def text(self, data: str) -> None:
        self.inbox.put_nowait({"type": "websocket.receive", "text": data})

    def binary(self, data: bytes) -> None:
        self.inbox.put_nowait({"type": "websocket.receive", "bytes": data})

    def disconnect(self, code: int = 1000, reason: str = "") -> None:
        self.inbox.put_nowait({"type": "websocket.disconnect", "code": code, "reason": reason})

    async def next(self, timeout: float = 5.0) -> dict[str, Any]:
        """The next message the proxy sent that was not returned yet."""
        async with asyncio.timeout(timeout):
            while len(self.sent) <= self._seen:
                self.new_message.clear()
                await self.new_message.wait()
        self._seen += 1
        return self.sent[self._seen - 1]

    async def done(self, timeout: float = 5.0) -> WsExchange:
        async with asyncio.timeout(timeout):
            await self.task
        return self


def relay_tasks() -> list[str]:
    """Names of the proxy's WebSocket relay tasks still running."""
    return [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("proxy-ws-")]

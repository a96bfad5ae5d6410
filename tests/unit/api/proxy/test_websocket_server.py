"""WebSocket through the proxy behind the front server the product runs (uvicorn, in this process) with a
real client (the ``websockets`` package): both routing modes, what the client sees of pings, closes from
either side and refusals, and a non-WebSocket upgrade on the wire.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import pytest_asyncio
import uvicorn
from websockets.asyncio.client import connect
from websockets.asyncio.server import serve
from websockets.exceptions import ConnectionClosed, InvalidStatus

from aenv.api.proxy import SandboxProxy
from bench.ws_echo_server import Echo
from tests.unit.api.proxy.helpers import FakeOrchestrator, Rig, relay_tasks

HEADERS = {"E2b-Sandbox-Id": "sbx", "E2b-Sandbox-Port": "8080"}


class Front:
    """uvicorn serving the proxy on a free port, in front of the echo server (bench/ws_echo_server.py) in the
    "sandbox"."""

    def __init__(self, proxy: SandboxProxy, orch: FakeOrchestrator, server: uvicorn.Server, echo: Echo) -> None:
        self.proxy, self.orch, self.server, self.echo = proxy, orch, server, echo

    @property
    def port(self) -> int:
        return int(self.server.servers[0].sockets[0].getsockname()[1])

    async def settled(self) -> None:
        """Until the relay let go of every stream and task."""
        async with asyncio.timeout(5):
            while self.proxy.upgraded or self.orch.host._streams or relay_tasks():
                await asyncio.sleep(0.01)


@pytest_asyncio.fixture(loop_scope="function")
async def front(rig: Rig) -> AsyncIterator[Callable[[], Awaitable[Front]]]:
    started: list[tuple[Any, uvicorn.Server, asyncio.Task[None]]] = []

    async def make() -> Front:
        echo = Echo()
        sandbox = await serve(echo.handler, "127.0.0.1", 0, max_size=None)
        proxy, orch, _ = await rig(upstream_port=sandbox.sockets[0].getsockname()[1])
        config = uvicorn.Config(proxy, host="127.0.0.1", port=0, lifespan="off", log_level="warning",
                                ws_max_size=32 << 20)  # fmt: skip
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())
        started.append((sandbox, server, task))
        while not server.started:
            await asyncio.sleep(0.01)
        return Front(proxy, orch, server, echo)

    yield make
    for sandbox, server, task in started:
        server.should_exit = True
        await task
        sandbox.close()
        await sandbox.wait_closed()


@pytest.mark.parametrize("mode", ["headers", "host"])
async def test_echo_ping_and_client_close_in_both_routing_modes(front: Any, mode: str) -> None:
    f = await front()
    if mode == "headers":
        kwargs: dict[str, Any] = {"uri": f"ws://127.0.0.1:{f.port}/ws", "additional_headers": HEADERS}
    else:  # what sbx.get_host(8080) names; *.localhost is resolved here by hand, as the test's own DNS
        kwargs = {"uri": f"ws://8080-sbx.localhost:{f.port}/ws", "host": "127.0.0.1", "port": f.port}
    async with connect(**kwargs, proxy=None, max_size=None) as ws:
        await ws.send("text")
        assert await ws.recv() == "text"
        await ws.send(b"\x00bin")
        assert await ws.recv() == b"\x00bin"
        big = bytes(range(256)) * 40960  # 10 MiB
        await ws.send(big)
        assert await ws.recv() == big
        assert await asyncio.wait_for(await ws.ping(b"x"), 5) >= 0  # answered (by the front server)
        await ws.close(4002, "done")
    await asyncio.wait_for(f.echo.ended.wait(), 5)
    assert f.echo.stats["closes"] == [[4002, "done"]]
    await f.settled()


async def test_the_sandbox_closes_and_the_client_sees_its_code(front: Any) -> None:
    f = await front()
    async with connect(f"ws://127.0.0.1:{f.port}/ws", additional_headers=HEADERS, proxy=None) as ws:
        await ws.send("close-me")
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
    assert closed.value.rcvd is not None and (closed.value.rcvd.code, closed.value.rcvd.reason) == (4001, "bye")
    await f.settled()
    # and the sandbox serves the next connection
    async with connect(f"ws://127.0.0.1:{f.port}/ws", additional_headers=HEADERS, proxy=None) as ws:
        await ws.send("again")
        assert await ws.recv() == "again"
    await f.settled()


@pytest.mark.parametrize(
    ("headers", "status", "words"),
    [
        ({"E2b-Sandbox-Id": "gone"}, 502, "was not found"),
        ({"E2b-Sandbox-Id": "sbx", "E2b-Sandbox-Port": "9"}, 502, "port is not open"),
        ({"E2b-Sandbox-Id": "sbx", "E2b-Sandbox-Port": "49983"}, 403, "internal envd route"),
    ],
)
async def test_refusals_reach_the_client_as_http(front: Any, headers: dict[str, str], status: int,
                                                 words: str) -> None:
    f = await front()
    path = "/init" if status == 403 else "/ws"
    with pytest.raises(InvalidStatus) as refused:
        async with connect(f"ws://127.0.0.1:{f.port}{path}", additional_headers=headers, proxy=None):
            pass
    assert refused.value.response.status_code == status
    assert words in json.loads(refused.value.response.body)["message"]
    await f.settled()


async def test_another_upgrade_is_a_501_on_the_wire(front: Any) -> None:
    f = await front()
    reader, writer = await asyncio.open_connection("127.0.0.1", f.port)
    try:
        writer.write(b"GET /x HTTP/1.1\r\nhost: 8080-sbx.localhost\r\nconnection: upgrade\r\nupgrade: tcp\r\n\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 5)  # connection: close: the server ends it
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 501 ") and b"connection: close" in head.lower()
    assert json.loads(body)["code"] == 501

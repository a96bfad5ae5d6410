"""The ``rig`` fixture: a SandboxProxy wired to a scripted upstream through a real mux (see helpers.py)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest_asyncio

from aenv.api.proxy import SandboxProxy
from aenv.mux import MuxSession
from tests.unit.api.proxy.helpers import FakeOrchestrator, Handler, Rig, Upstream


async def _unused(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    raise AssertionError("no upstream handler")


@pytest_asyncio.fixture(loop_scope="function")  # torn down on the loop its servers and sessions run on
async def rig() -> AsyncIterator[Rig]:
    cleanups: list[Callable[[], Awaitable[None]]] = []

    async def make(
        handler: Handler | None = None, port: int = 8080, upstream_port: int | None = None
    ) -> tuple[SandboxProxy, FakeOrchestrator, Upstream]:
        """``handler`` serves each upstream connection; or ``upstream_port`` names a server the test runs."""
        upstream = Upstream(handler or _unused)
        real_port = upstream_port or await upstream.start()

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
            if upstream.server is not None:
                upstream.server.close()

        cleanups.append(cleanup)
        return proxy, orch, upstream

    yield make
    for c in cleanups:
        await c()

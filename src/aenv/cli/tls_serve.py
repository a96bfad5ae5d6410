"""``aenv serve`` with TLS: the same ASGI app under hypercorn, which negotiates HTTP/2 by ALPN (``h2``,
falling back to ``http/1.1``). Plain HTTP stays on uvicorn (``local.py``), which has no HTTP/2.

Why HTTP/2: E2B's SDKs (Python ≥ 2.35, transport pyqwest) speak it to envd over TLS, and they tell "the
sandbox died mid-request" from an error answer by the *transport* failing: on E2B an HTTP/2 stream reset.
The proxy ends such a stream by returning without finishing the response (``api/proxy``: over HTTP/1.1
the connection is then cut, or a Connect stream gets an ``unavailable`` end first). Over h2 hypercorn
0.17-0.18 leaves a stream whose app returned mid-response open forever (its stream buffer never
completes), so the client hangs: :class:`_ResettingH2` resets it (RST_STREAM ``INTERNAL_ERROR``), which is
what both the old and the new SDKs take for a transport failure and answer with a ``/health`` probe.

Kept from the uvicorn setup: the bind address, keep-alive 75 s, no ``server`` header, no access log,
the largest WebSocket message, graceful shutdown on SIGINT/SIGTERM and the app's lifespan (without
hypercorn's 60 s limits: uvicorn had none)."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import h2.errors
import h2.exceptions
import hypercorn.protocol
from hypercorn.asyncio import serve
from hypercorn.config import Config
from hypercorn.protocol.events import EndBody, EndData, StreamClosed, Trailers
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.h2 import H2Protocol

from aenv.config import Settings

# How long in-flight requests get after a stop signal before their connections are closed.
GRACEFUL_TIMEOUT = 10.0
# The app's lifespan (store, runtime, orchestrator) may take long on a cold or busy host.
LIFESPAN_TIMEOUT = 3600.0


class _ResettingH2(H2Protocol):
    """hypercorn's HTTP/2 protocol, except that a stream whose app finished without ending the response
    (a proxied body cut mid-way) is reset instead of left open."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ended: set[int] = set()  # streams whose response reached its end (body or trailers)

    async def stream_send(self, event: StreamEvent) -> None:
        if isinstance(event, (EndBody, EndData, Trailers)):
            self._ended.add(event.stream_id)
        elif isinstance(event, StreamClosed):
            if event.stream_id not in self._ended and event.stream_id in self.stream_buffers:
                await self._reset(event.stream_id)
            self._ended.discard(event.stream_id)
        await super().stream_send(event)

    async def _reset(self, stream_id: int) -> None:
        try:
            self.connection.reset_stream(stream_id, error_code=h2.errors.ErrorCodes.INTERNAL_ERROR)
        except h2.exceptions.H2Error:  # the client closed or reset it first
            pass
        else:
            await self._flush()
        # The sender task then finds the buffer complete, its stream closed, and drops both.
        await self.stream_buffers[stream_id].close()
        self.priority.unblock(stream_id)
        await self.has_data.set()


def _bind(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def hypercorn_config(settings: Settings) -> Config:
    """The hypercorn settings equivalent to ``local.serve``'s uvicorn ones, with TLS and ALPN h2."""
    config = Config()
    config.bind = [_bind(settings.host, settings.port)]
    config.certfile = str(settings.tls_cert)
    config.keyfile = str(settings.tls_key)
    config.alpn_protocols = ["h2", "http/1.1"]
    config.keep_alive_timeout = 75
    config.include_server_header = False
    config.websocket_max_message_size = settings.ws_max_message
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.loglevel = settings.log_level.upper()
    config.graceful_timeout = GRACEFUL_TIMEOUT
    config.startup_timeout = LIFESPAN_TIMEOUT
    config.shutdown_timeout = LIFESPAN_TIMEOUT
    return config


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def serve_tls(app: Any, settings: Settings, shutdown_trigger: Callable[[], Awaitable[None]]) -> None:
    """Serve ``app`` over HTTPS (h2 and HTTP/1.1) until ``shutdown_trigger`` returns, then drain."""
    hypercorn.protocol.H2Protocol = _ResettingH2  # type: ignore[attr-defined]  # what ProtocolWrapper builds
    await serve(app, hypercorn_config(settings), shutdown_trigger=shutdown_trigger)


def run_tls(app: Any, settings: Settings) -> None:
    """``aenv serve`` with TLS: until SIGINT or SIGTERM."""
    asyncio.run(serve_tls(app, settings, _until_signalled))

"""Server-Sent Events for the console's event stream, on a node and merged on a gateway: the frames, and
one response that writes a queue of frames out with keep-alives.

A queue carries ready frames (``bytes``); ``None`` ends the stream (the browser's EventSource reconnects
after ``retry`` and reloads what it shows).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi.responses import StreamingResponse

KEEPALIVE_S = 15.0  # a comment line this often keeps idle proxies from closing the stream
RETRY = b"retry: 2000\n\n"
KEEPALIVE = b": keepalive\n\n"
RESYNC = b"event: resync\ndata: {}\n\n"  # events were missed: reload


def frame(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: ".encode() + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


async def frames(queue: asyncio.Queue[bytes | None], keepalive_s: float = KEEPALIVE_S) -> AsyncIterator[bytes]:
    """The queue's frames, a keep-alive whenever it stays quiet for ``keepalive_s``, until ``None``."""
    yield RETRY
    while True:
        try:
            item = await asyncio.wait_for(queue.get(), keepalive_s)
        except TimeoutError:
            yield KEEPALIVE
            continue
        if item is None:
            return
        yield item


def response(body: AsyncIterator[bytes]) -> StreamingResponse:
    from fastapi.responses import StreamingResponse  # here: the simulated nodes write frames without FastAPI

    return StreamingResponse(body, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip

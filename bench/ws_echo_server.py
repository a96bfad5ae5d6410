"""A WebSocket echo server to run inside a sandbox (and on the host, as the bench's baseline): the
``websockets`` package's asyncio server, shipped with it in one zip (``bench.ws.bundle``), so a sandbox
needs only python3. Run as ``python3 wsecho.pyz PORT``; it prints ``ready`` once it listens.

Every message is echoed, except these texts, which let a test drive what only the server side can do:
``close-me`` (close with 4001 "bye"), ``ping-me`` (ping the client, answer "ponged" after its pong),
``fragments`` (one message in three frames), ``drop`` (abort the TCP connection, no close frame),
``half-close`` (TCP half close, no close frame). ``GET /stats`` (plain HTTP) answers JSON: connections
open now and accepted in all, and how each ended (close code and reason as the server saw them).
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from websockets.asyncio.server import ServerConnection, serve
from websockets.http11 import Request, Response


class Echo:
    """The server's handlers and what it saw (``stats``; ``ended`` is set each time a connection ends)."""

    def __init__(self) -> None:
        self.stats: dict[str, Any] = {"open": 0, "accepted": 0, "closes": []}
        self.ended = asyncio.Event()

    async def handler(self, ws: ServerConnection) -> None:
        self.stats["open"] += 1
        self.stats["accepted"] += 1
        try:
            async for msg in ws:
                if msg == "close-me":
                    await ws.close(4001, "bye")
                elif msg == "ping-me":
                    await (await ws.ping(b"probe"))
                    await ws.send("ponged")
                elif msg == "fragments":
                    await ws.send(iter(["ab", "cd", "ef"]))
                elif msg == "drop":
                    ws.transport.abort()
                elif msg == "half-close":
                    ws.transport.write_eof()
                else:
                    await ws.send(msg)
        finally:
            self.stats["open"] -= 1
            self.stats["closes"].append([ws.close_code, ws.close_reason])
            self.ended.set()

    def process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        if request.path == "/stats":
            return connection.respond(200, json.dumps(self.stats) + "\n")
        return None


async def main(port: int) -> None:
    echo = Echo()
    async with serve(echo.handler, "0.0.0.0", port, max_size=None, process_request=echo.process_request,
                     ping_interval=None):
        print("ready", flush=True)
        await asyncio.Future()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))

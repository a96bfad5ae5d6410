"""Node probes over the forwarder's kept-alive connections (no httpx request per probe): they report the
node's load, reuse one connection, and mark a node down when it stops answering."""

from __future__ import annotations

import asyncio
import json

import httpx

from aenv.gateway.forward import Forwarder
from aenv.gateway.nodes import Node, NodeSet


async def _scenario() -> tuple[list[bool], int, dict[str, int], str, list[str]]:
    accepted = 0
    heads: list[str] = []
    info = json.dumps({"version": "x", "sandboxes": {"running": 3}, "starting": 1, "warm": {"t1": 2}}).encode()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            heads.append(head.decode())
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(info)
                         + info)  # fmt: skip
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    node = Node("n1", f"http://127.0.0.1:{port}", "127.0.0.1", port)
    nodes = NodeSet([node], httpx.AsyncClient(), "key1")
    forwarder = Forwarder(nodes)

    async def probe_get(n: Node, path: str, headers: dict[str, str], timeout: float) -> tuple[int, bytes]:
        got = await forwarder.get(n, path, headers, timeout)
        return got.status, got.body

    nodes.probe_get = probe_get
    ups = []
    for _ in range(3):
        await nodes.probe(node)
        ups.append(node.up)
    counts = dict(node.counts)
    server.close()
    await forwarder.aclose()  # the kept-alive connection goes too: the next probe must connect, and cannot
    await server.wait_closed()
    await nodes.probe(node)
    ups.append(node.up)
    return ups, accepted, counts, node.reason, heads


def test_probes_reuse_one_connection_and_mark_a_silent_node_down() -> None:
    ups, accepted, counts, reason, heads = asyncio.run(_scenario())
    assert ups == [True, True, True, False]
    assert accepted == 1  # three probes, one connection
    assert counts == {"running": 3}
    assert "NodeUnreachable" in reason
    assert heads[0].startswith("GET /aenv/info HTTP/1.1\r\n") and "x-api-key: key1\r\n" in heads[0].lower()

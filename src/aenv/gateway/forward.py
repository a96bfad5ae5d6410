"""Relaying one control-plane request to a node and its answer back.

The request goes out through the proxy's hand-written HTTP/1.1 codec over kept-alive TCP connections per
node (what httpx cost was ~1.8 ms a hop, more than the rest of a create's overhead), and the answer is
read with the proxy's own response relay into memory: control-plane bodies are small JSON, and the
gateway reads create and fork answers anyway, to learn the IDs. Headers pass unchanged, the client's
``Host`` included: a node builds the sandbox ``domain`` from it, so ``get_host()`` names the gateway.

A node that cannot be connected to is marked down here (``NodeUnreachable``); the caller decides whether
another node may take the request instead (a create may; a request about a sandbox may not). A kept-alive
connection that the node closed while idle is replaced and the request sent again, since nothing of it
reached the node. ``stream`` relays a request whose bodies may be large (the volume content API) as the
proxy does, both ways as they come, on a fresh connection.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from aenv.api.proxy.codec import Message, Receive, Send, request_head
from aenv.api.proxy.relay import (
    _Exchange,
    _NoResponse,
    _pump_and_watch,
    _relay_response,
    read_response_head,
    relay_body,
    start_request,
)
from aenv.api.proxy.routing import json_error, respond
from aenv.gateway.nodes import Node, NodeSet
from aenv.mux import ByteStream, MuxError
from aenv.mux.direct import open_tcp

NODE_HEADER = "X-Aenv-Node"  # on every relayed answer: the node that gave it
CONNECT_TIMEOUT = 3.0
ANSWER_TIMEOUT = 900.0  # a create may wait in a node's admission queue, a fork copy for minutes
MAX_IDLE_PER_NODE = 32
_FRAMING = (b"content-length", b"transfer-encoding")


class NodeError(Exception):
    """A request to a node failed: ``NodeUnreachable`` (it never got there) or ``NodeBrokeOff``."""

    def __init__(self, node: Node, message: str) -> None:
        super().__init__(message)
        self.node = node


class NodeUnreachable(NodeError):
    """The request never reached the node (connect failed): it did nothing there."""

    def __init__(self, node: Node, cause: BaseException) -> None:
        super().__init__(node, f"node {node.id} ({node.url}) is unreachable: {type(cause).__name__}: {cause}")


class NodeBrokeOff(NodeError):
    """The request went out and no whole answer came back: what it did on the node is not known."""

    def __init__(self, node: Node, cause: BaseException) -> None:
        super().__init__(node, f"node {node.id} ({node.url}) broke off its answer: {type(cause).__name__}: {cause}")


class Relayed:
    """A node's answer: status, headers, raw body, and the node."""

    __slots__ = ("status", "headers", "body", "node")

    def __init__(self, status: int, headers: list[tuple[str, str]], body: bytes, node: Node) -> None:
        self.status = status
        self.headers = headers
        self.body = body
        self.node = node

    def response(self) -> Response:
        out = Response(self.body, status_code=self.status)
        for k, v in self.headers:
            if k != "content-length":  # Response sets its own
                out.headers.append(k, v)
        if not self.plain_not_found():
            out.headers[NODE_HEADER] = self.node.id
        return out

    def plain_not_found(self) -> bool:
        """A 404 without a reason: a node's answer for an ID it does not know, or one of another team.
        Relayed as the gateway answers an ID no node knows, without naming the node."""
        if self.status != 404:
            return False
        try:
            parsed = json.loads(self.body)
        except ValueError:
            return False
        return isinstance(parsed, dict) and "reason" not in parsed


class _Collect:
    """An ASGI ``send`` that keeps what the relay sends: the answer, whole."""

    def __init__(self) -> None:
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.body = bytearray()

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"]]
        else:
            self.body += message.get("body", b"")


class Forwarder:
    """Sends requests to nodes over kept-alive connections; marks a node down when it cannot be reached."""

    def __init__(self, nodes: NodeSet) -> None:
        self.nodes = nodes
        self._idle: dict[str, list[ByteStream]] = {}

    async def send(
        self, request: Request, node: Node, body: bytes | None = None, path: str | None = None,
        query: str | None = None, extra: dict[str, str] | None = None, method: str | None = None,
    ) -> Relayed:  # fmt: skip
        """``request`` as it came (or with ``body``/``path``/``query``/``method`` replaced, ``extra`` headers
        set) to ``node``."""
        content = await request.body() if body is None else body
        scope: dict[str, Any] = dict(request.scope)
        added = {k.lower().encode(): v.encode() for k, v in (extra or {}).items()}
        scope["headers"] = [(k, v) for k, v in scope["headers"] if k not in _FRAMING and k not in added]
        scope["headers"] += [*added.items(), (b"content-length", b"%d" % len(content))]
        if path is not None:
            scope["path"], scope["raw_path"] = path, None
        if query is not None:
            scope["query_string"] = query.encode()
        if method is not None:
            scope["method"] = method
        verb: str = scope["method"]
        head, _ = request_head(scope)
        try:
            return await self._round_trip(verb, node, head + content, ANSWER_TIMEOUT)
        except NodeBrokeOff as exc:
            cause = exc.__cause__
            self.nodes.mark_down(node, f"broke off an answer: {type(cause).__name__}: {cause}")
            raise

    async def get(self, node: Node, path: str, headers: dict[str, str], timeout: float) -> Relayed:
        """A GET of the gateway's own (the node probes) over the same kept-alive connections: no httpx
        request per probe (at 1,000 nodes httpx's per-request cost and its pool's scan of every connection
        took a core, and probes timed out in the queue). Raises NodeUnreachable or NodeBrokeOff (the
        caller decides whether the node is down), TimeoutError past ``timeout``."""
        lines = [f"GET {path} HTTP/1.1", f"host: {node.host}:{node.port}", "content-length: 0",
                 *(f"{k}: {v}" for k, v in headers.items())]  # fmt: skip
        return await self._round_trip("GET", node, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"), timeout)

    async def _round_trip(self, verb: str, node: Node, data: bytes, timeout: float) -> Relayed:
        """``data`` (a whole request) sent to ``node``, its whole answer back, on a kept-alive connection."""
        try:
            async with asyncio.timeout(timeout):
                stream, reused = await self._acquire(node)
                try:
                    return await self._exchange(verb, node, stream, data)
                except (MuxError, _NoResponse):
                    if not reused:
                        raise
                    # The node closed this idle connection: the request never reached it; a fresh one takes it.
                    stream, _ = await self._acquire(node, fresh=True)
                    return await self._exchange(verb, node, stream, data)
        except NodeUnreachable:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever broke the answer, the caller hears which node
            raise NodeBrokeOff(node, exc) from exc

    async def stream(self, scope: dict[str, Any], receive: Receive, send: Send, node: Node) -> None:
        """``scope``'s request to ``node``, its body pumped up and the answer relayed down as they come
        (never held whole). A node that cannot be reached is a 503 naming it; one that breaks off before
        its answer began, a 502."""
        started = await start_request(scope, receive)
        if started is None:
            return
        head, framing, more_body = started
        try:
            stream, _ = await self._acquire(node, fresh=True)
        except NodeUnreachable as exc:
            await respond(send, *json_error(503, {"code": 503, "message": str(exc), "reason": "node_down",
                                                  "node": node.id}))  # fmt: skip
            return
        ex = _Exchange(stream, body_sent=not more_body)
        helper: asyncio.Task[None] | None = None
        try:
            await stream.write(head)
            helper = asyncio.create_task(_pump_and_watch(receive, framing == "chunked", more_body, ex))
            await _relay_response(scope["method"], send, stream, ex)
        except Exception as exc:  # noqa: BLE001 - the client hears which node, or its connection drops mid-answer
            ex.finished = True
            if not (ex.gone or ex.started):
                self.nodes.mark_down(node, f"broke off an answer: {type(exc).__name__}: {exc}")
                await respond(send, *json_error(502, {"code": 502, "message": str(NodeBrokeOff(node, exc)),
                                                      "reason": "node_failed", "node": node.id}))  # fmt: skip
        finally:
            if helper is not None:
                helper.cancel()
            ex.finished = True
            await stream.aclose()

    async def _exchange(self, method: str, node: Node, stream: ByteStream, data: bytes) -> Relayed:
        ex = _Exchange(stream, body_sent=True)
        try:
            await stream.write(data)
            buf = bytearray()
            head = await read_response_head(stream, buf)
            got = _Collect()
            await relay_body(method, head, buf, got, stream, ex)
        except BaseException:
            await stream.aclose()
            raise
        if ex.reusable:
            idle = self._idle.setdefault(node.id, [])
            if len(idle) < MAX_IDLE_PER_NODE:
                idle.append(stream)
            else:
                await stream.aclose()
        else:
            await stream.aclose()
        return Relayed(got.status, got.headers, bytes(got.body), node)

    async def _acquire(self, node: Node, fresh: bool = False) -> tuple[ByteStream, bool]:
        idle = self._idle.get(node.id)
        while idle and not fresh:
            stream = idle.pop()
            if not (stream.closed or stream.at_eof or stream.buffered):
                return stream, True
            await stream.aclose()
        try:
            return await asyncio.wait_for(open_tcp(node.host, node.port), CONNECT_TIMEOUT), False
        except (OSError, TimeoutError) as exc:
            self.nodes.mark_down(node, f"{type(exc).__name__}: {exc}")
            raise NodeUnreachable(node, exc) from exc

    async def aclose(self) -> None:
        idle, self._idle = self._idle, {}
        for streams in idle.values():
            for stream in streams:
                await stream.aclose()

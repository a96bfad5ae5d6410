"""Relaying one control-plane request to a node and its answer back, over a pooled httpx client.

Control-plane bodies are small JSON, so the request is read whole and the answer buffered (the gateway
reads create and fork answers anyway, to learn the IDs). Headers pass unchanged, the client's ``Host``
included: a node builds the sandbox ``domain`` from it, so ``get_host()`` names the gateway, not the node.
A node that cannot be connected to is marked down here (``NodeUnreachable``); the caller decides whether
another node may take the request instead (a create may; a request about a sandbox may not).
"""

from __future__ import annotations

import httpx
from fastapi import Request
from fastapi.responses import Response

from aenv.gateway.nodes import Node, NodeSet

_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"te", b"upgrade",
                  b"proxy-connection", b"trailer", b"expect"})  # fmt: skip
_HOP_STR = frozenset(h.decode() for h in _HOP)
NODE_HEADER = "X-Aenv-Node"  # on every relayed answer: the node that gave it


class NodeUnreachable(Exception):
    """The request never reached the node (connect failed): it did nothing there."""

    def __init__(self, node: Node, cause: Exception) -> None:
        super().__init__(f"node {node.id} ({node.url}) is unreachable: {type(cause).__name__}: {cause}")
        self.node = node


class Relayed:
    """A node's answer: status, headers, raw body, and the node."""

    __slots__ = ("status", "headers", "body", "node")

    def __init__(self, status: int, headers: list[tuple[str, str]], body: bytes, node: Node) -> None:
        self.status = status
        self.headers = headers
        self.body = body
        self.node = node

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k == name), None)

    def response(self, body: bytes | None = None) -> Response:
        headers = [(k, v) for k, v in self.headers if k not in _HOP_STR]
        out = Response(self.body if body is None else body, status_code=self.status)
        for k, v in headers:
            out.headers.append(k, v)
        out.headers[NODE_HEADER] = self.node.id
        return out


class Forwarder:
    """Sends requests to nodes; marks a node down when it cannot be connected to."""

    def __init__(self, nodes: NodeSet, client: httpx.AsyncClient) -> None:
        self.nodes = nodes
        self.client = client

    async def send(
        self, request: Request, node: Node, body: bytes | None = None, path: str | None = None,
        query: bytes | None = None,
    ) -> Relayed:  # fmt: skip
        """``request`` as it came (or with ``body``/``path``/``query`` replaced) to ``node``."""
        content = await request.body() if body is None else body
        headers = [(k, v) for k, v in request.headers.raw if k not in _HOP]
        qs = request.url.query.encode() if query is None else query
        url = node.url + (path if path is not None else request.url.path) + ("?" + qs.decode() if qs else "")
        req = self.client.build_request(request.method, url, headers=headers, content=content)
        try:
            r = await self.client.send(req, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            self.nodes.mark_down(node, f"{type(exc).__name__}: {exc}")
            raise NodeUnreachable(node, exc) from exc
        try:
            data = b"".join([chunk async for chunk in r.aiter_raw()])
        finally:
            await r.aclose()
        return Relayed(r.status_code, [(k.decode().lower(), v.decode("latin-1")) for k, v in r.headers.raw], data, node)

"""The gateway's ASGI app: its control plane (FastAPI) behind the sandbox proxy, on one port, as a node's.

The lifespan owns the long-lived objects: the node connections (relayed requests: ``Forwarder``; probes
and lookups: an httpx client), the node probes, the binding cache, and with ``redis`` the directory's
follower. Nothing is stored: a restarted gateway learns bindings again from the directory or the nodes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from aenv import __version__
from aenv.api import console, errors
from aenv.api.errors import error_response
from aenv.api.proxy.routing import ENVD_PORT
from aenv.gateway.builds import router as builds_router
from aenv.gateway.builds import uploads as build_uploads_router
from aenv.gateway.console_ops import router as console_ops_router
from aenv.gateway.console_reads import router as console_read_router
from aenv.gateway.control import Gateway, router
from aenv.gateway.control import create as create_route
from aenv.gateway.directory import AskNodes, Locator
from aenv.gateway.fast_routes import FastRoutes
from aenv.gateway.forward import Forwarder, NodeBrokeOff
from aenv.gateway.leases import router as leases_router
from aenv.gateway.nodes import Node, NodeSet
from aenv.gateway.per_node import router as per_node_router
from aenv.gateway.proxy import GatewayProxy
from aenv.gateway.secrets import router as secrets_router
from aenv.gateway.volumes import control as volumes_router
from aenv.teams import Quota, TeamDirectory

log = logging.getLogger("aenv.gateway")

WS_MAX_MESSAGE = 16 * 1024 * 1024


@dataclass
class GatewaySettings:
    """What one gateway needs: its nodes, the keys it accepts, the key it probes nodes with."""

    nodes: list[Node]
    api_keys: list[str] = field(default_factory=list)
    node_key: str | None = None  # sent on the gateway's own calls (probes, lookups); default: a plain api key
    probe_interval: float = 1.0
    redis: str | None = None  # the cluster directory: nodes and bindings from it (cluster.py)
    ws_max_message: int = WS_MAX_MESSAGE
    admin_keys: list[str] = field(default_factory=list)  # the nodes' admin_keys (a lookup uses one)
    teams: TeamDirectory | None = None  # keys -> teams, as the nodes have them (default: from api_keys)

    def probe_key(self) -> str | None:
        """The key of the gateway's own calls (probes, lookups): ``node_key``, else a plain admin key (a
        lookup must find any team's sandbox), else a plain API key."""
        if self.node_key is not None:
            return self.node_key
        plain = [k for k in (*self.admin_keys, *self.api_keys) if not k.startswith("sha256:")]
        return plain[0] if plain else None


def create_gateway_app(settings: GatewaySettings) -> Any:
    """Build the ASGI app. The objects are made here; the lifespan starts the probes and closes them."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=60)
    timeout = httpx.Timeout(connect=3.0, read=900.0, write=60.0, pool=30.0)
    client = httpx.AsyncClient(trust_env=False, limits=limits, timeout=timeout)
    key = settings.probe_key()
    nodes = NodeSet(settings.nodes, client, key, settings.probe_interval)
    ask = AskNodes(nodes, client, key)
    follower: Any = None
    if settings.redis:
        from aenv.directory.reader import DirectoryReader
        from aenv.gateway.cluster import Follower, RedisDirectory

        reader = DirectoryReader(settings.redis)
        locator = Locator(nodes, RedisDirectory(reader, ask))
        follower = Follower(reader, nodes, locator, settings.probe_interval)
    else:
        locator = Locator(nodes, ask)
    forwarder = Forwarder(nodes)

    async def probe_get(node: Node, path: str, headers: dict[str, str], timeout: float) -> tuple[int, bytes]:
        got = await forwarder.get(node, path, headers, timeout)
        return got.status, got.body

    nodes.probe_get = probe_get  # probes over the forwarder's kept-alive connections, not an httpx request each
    gateway = Gateway(nodes, locator, forwarder)
    gateway.shared_secrets = bool(settings.redis)  # its nodes are cluster-mode nodes of that Redis

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.gateway = gateway
        app.state.teams = gateway.teams = settings.teams or TeamDirectory(settings.api_keys, {}, [], Quota())
        if follower is not None:
            await follower.start()  # the node list first: the probes then reach every node
        await nodes.start()
        up = ", ".join(f"{n.id}={n.url} ({'up' if n.up else 'down: ' + n.reason})" for n in nodes.nodes.values())
        log.info("aenv %s gateway in front of %d nodes: %s", __version__, len(nodes.nodes), up)
        try:
            yield
        finally:
            await proxy.aclose()
            await nodes.aclose()
            if follower is not None:
                await follower.aclose()
            await forwarder.aclose()
            await client.aclose()

    api = FastAPI(title="aenv gateway", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)  # fmt: skip
    errors.install(api)

    @api.exception_handler(NodeBrokeOff)
    async def _broke_off(_: Request, exc: NodeBrokeOff) -> JSONResponse:
        return error_response(502, str(exc), None, reason="node_failed", node=exc.node.id)

    @api.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok", "version": __version__, "role": "gateway", "nodesUp": len(nodes.up()),
                             "nodes": len(nodes.nodes)})  # fmt: skip

    # before router: its template routes are broader, and its last route answers 501 for what it does not relay
    for extra in (volumes_router, builds_router, build_uploads_router, leases_router, per_node_router,
                  console_read_router, console_ops_router, secrets_router):
        api.include_router(extra)
    api.state.console_client = client
    console.install(api, "gateway")  # before router, whose last route takes every path
    api.include_router(router)
    fast = FastRoutes(api, {("POST", "/sandboxes"): create_route, ("POST", "/v2/sandboxes"): create_route})
    proxy = GatewayProxy(api, locator, nodes, settings.ws_max_message, forwarder, fast)  # type: ignore[arg-type]
    gateway.on_created.append(lambda sandbox_id: proxy.pool.prewarm(sandbox_id, ENVD_PORT))
    return proxy

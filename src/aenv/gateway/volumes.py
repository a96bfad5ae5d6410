"""E2B volumes through the gateway. A volume's files are on one node's disk, so everything about it goes
to that node:

- ``POST /volumes`` goes to a node chosen by placement (a node that cannot be reached is skipped), or, when
  a node already holds a volume of that name, to that node, which answers the 409 itself; the node binds
  the new volume in the cluster directory (where a name is unique across the nodes, atomically);
- ``GET``/``DELETE /volumes/{id}`` and the content API (``/volumecontent/{id}/…``) go to the volume's node; ``GET /volumes`` merges the live nodes' lists and names the
  nodes skipped in ``X-Aenv-Nodes-Down``;
- a create with ``volumeMounts`` is placed on the node that holds its volumes (``mount_home``): volumes on
  two nodes are a 400 naming them. A volume whose node is down is a 503 naming the node (the volume is
  not lost: its files come back with the node); one no node knows is a 404.

The content API (the volume's bearer token, no API key: the node checks it) is relayed as a stream both
ways, ahead of the routes (``relay_content``, called by ``proxy.GatewayProxy``), so a large file is never
held whole by the gateway.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from aenv.api.auth import principal, require_api_key
from aenv.api.errors import error_response
from aenv.api.proxy.codec import Receive, Scope, Send
from aenv.api.proxy.routing import respond
from aenv.gateway.directory import GatewayError, Locator, OwnerDown, down_message
from aenv.gateway.forward import Forwarder, NodeUnreachable
from aenv.gateway.nodes import Node

if TYPE_CHECKING:
    from aenv.gateway.control import Gateway

control = APIRouter(dependencies=[Depends(require_api_key)])
READ_ONLY_SUFFIX = ":ro"  # core.volumes: a plain mount name with it is a read-only mount


def _gw(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


def _auth(request: Request) -> dict[str, str]:
    """The client's credentials, for asking nodes about its volumes (they are scoped to its key)."""
    return {k: v for k, v in request.headers.items() if k in ("x-api-key", "authorization")}


def _error(exc: GatewayError) -> JSONResponse:
    """A volume on a node that is down is a 503 (it is not gone); one no live node knows, a 404."""
    extra: dict[str, str] = {"node": exc.node.id} if exc.node is not None else {}
    if exc.reason:
        extra["reason"] = exc.reason
    return error_response(503 if isinstance(exc, OwnerDown) else 404, exc.message, None, **extra)


def _unreachable(exc: NodeUnreachable) -> JSONResponse:
    return error_response(503, str(exc), None, reason="node_down", node=exc.node.id)


async def mount_home(gw: Gateway, request: Request, body: bytes) -> Node | Response | None:
    """Where a create must go for its ``volumeMounts``: the node holding them (None: no mounts, or no
    node knows them, and the node the create lands on answers for them), or the error answer."""
    try:
        mounts = json.loads(body).get("volumeMounts") if body else None
    except (ValueError, AttributeError):
        return None  # the node says what is wrong with the body
    if not isinstance(mounts, list) or not mounts:
        return None
    names = []
    for m in mounts:
        name = m.get("name") if isinstance(m, dict) else None
        if isinstance(name, str) and name:
            names.append(name.removesuffix(READ_ONLY_SUFFIX))
    homes: dict[str, Node] = {}
    for name in dict.fromkeys(names):
        node = await gw.locator.volume_home(name, principal(request).team, _auth(request))
        if node is not None:
            homes[name] = node
    nodes = {n.id: n for n in homes.values()}
    if len(nodes) > 1:
        where = ", ".join(f"'{name}' on node {n.id}" for name, n in homes.items())
        return error_response(400, f"volumeMounts: a sandbox mounts volumes of one node, and these are on "
                                   f"{len(nodes)}: {where}", None, reason="volumes_split")  # fmt: skip
    if not nodes:
        return None
    node = next(iter(nodes.values()))
    if not node.up:
        named = ", ".join(f"'{name}'" for name in homes)
        return error_response(503, down_message(f"volumeMounts: volume {named}", node), None, reason="node_down",
                              node=node.id)  # fmt: skip
    return node


@control.post("/volumes")
async def create_volume(request: Request) -> Response:
    gw = _gw(request)
    body = await request.body()
    try:
        name = json.loads(body).get("name") if body else None
    except (ValueError, AttributeError):
        name = None
    home = await gw.locator.volume_home(name, principal(request).team, _auth(request)) if isinstance(name, str) else None
    tried: set[str] = set()
    while True:
        node = home if home is not None and home.up and home.id not in tried else gw.place(tried, None, None)
        if node is None:
            return gw.none_up(tried)
        try:
            got = await gw.forwarder.send(request, node, body)
        except NodeUnreachable:
            tried.add(node.id)
            continue
        try:
            parsed: Any = json.loads(got.body) if got.status == 201 else None
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(vid := parsed.get("volumeID"), str):
            gw.locator.remember_volume(vid, node.id)
        return got.response()


@control.get("/volumes")
async def list_volumes(request: Request) -> Response:
    answers, skipped = await _gw(request).fan_out(request)
    items: list[Any] = []
    for got in answers:
        if got.status != 200:
            return got.response()
        items += json.loads(got.body)
    headers = {"X-Aenv-Nodes-Down": ",".join(n.id for n in skipped)} if skipped else None
    return JSONResponse(items, headers=headers)


async def _to_volume(request: Request, volume_id: str, probe: str) -> Response:
    gw = _gw(request)
    try:
        node = await gw.locator.volume_owner(volume_id, probe, _auth(request))
        got = await gw.forwarder.send(request, node)
    except GatewayError as exc:
        return _error(exc)
    except NodeUnreachable as exc:
        return _unreachable(exc)
    if request.method == "DELETE" and request.url.path.startswith("/volumes/") and got.status == 204:
        gw.locator.forget_volume(volume_id)
    return got.response()


@control.api_route("/volumes/{volume_id}", methods=["GET", "DELETE"])
async def volume_scoped(request: Request, volume_id: str) -> Response:
    return await _to_volume(request, volume_id, f"/volumes/{volume_id}")


async def relay_content(locator: Locator, forwarder: Forwarder, scope: Scope, receive: Receive, send: Send) -> None:
    """The content API (``/volumecontent/{id}/…``, ASGI, ahead of the routes): to the volume's node,
    streamed both ways (files may be large)."""
    parts = scope["path"].split("/")
    volume_id = parts[2] if len(parts) > 3 else ""
    auth = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in (b"authorization", b"x-api-key")}
    try:
        node = await locator.volume_owner(volume_id, f"/volumecontent/{volume_id}/path?path=/", auth)
    except GatewayError as exc:
        refused = _error(exc)
        await respond(send, refused.status_code, bytes(refused.body))
        return
    await forwarder.stream(scope, receive, send, node)

"""Template builds through the gateway (``Template.build``). Two ways, by what the nodes share:

**Build once** (every live node names the same shared store, ``templateStore`` in its ``/aenv/info``:
``snapshot_store`` set to one ``file://`` directory or S3 bucket for all): the build runs on one node,
placed like a create (a node that holds the template already, with its cached steps, is preferred).
Once its steps are done that node publishes the result to the store (``core/template_share.py``: the
snapshot's content-addressed layers, then a template manifest with its IDs, names, tags and build ID)
and only then says ``ready``. Any other node, one down during the build or added after it included,
fetches it from the store the first time a sandbox of it lands there, under the same IDs and tags.
Deletes through the gateway reach every node and the store (``control.py``).

**Replay** (no shared store: each node's store is its own): the build is replayed on every live node
under the same template and build IDs, so a create of it (by name or by ID) may land on any of them.
What that gives up: each node runs the steps itself, so a step whose output is not deterministic (a
timestamp, a download of "latest") may differ between nodes, as two ``docker build`` runs do; a node
down during the build never gets the template (build or pull again there once it is back).

The gateway keeps no state between the SDK's calls (any replica may take any of them): each call after
the first goes to every live node, and the nodes that do not know the build (404) are left out when
building once.

- ``POST /v3/templates``: building once, to the placed node; replaying, to it, then to every other
  live node with its IDs (``X-Aenv-Build-Ids``); nodes that are down are named in ``X-Aenv-Nodes-Down``;
- ``GET /templates/{id}/files/{hash}`` asks every node; the upload link (when some node lacks the files)
  is the gateway's, carrying each such node's own signed token, and its ``PUT`` goes to each of them;
- ``POST /v2/templates/{id}/builds/{build}`` and tag changes go to every live node: any refusal is the
  answer, naming its node;
- the status is ``error`` when any node's build failed (the reason names the node), ``ready`` when every
  node's is, else ``building``; the logs are one node's (the first by name), so the SDK's offset holds.

Uploads are relayed whole (in memory), as every control-plane relay is.
"""

from __future__ import annotations

import asyncio
import base64
import json
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from aenv.api.auth import require_api_key
from aenv.api.errors import error_response
from aenv.gateway.control import _parsed
from aenv.gateway.control import gateway as _gw
from aenv.gateway.forward import NodeUnreachable, Relayed
from aenv.gateway.nodes import Node

if TYPE_CHECKING:
    pass

router = APIRouter(dependencies=[Depends(require_api_key)])
uploads = APIRouter()  # the link is signed by the nodes, no API key (the SDK sends none there)
BUILD_IDS_HEADER = "X-Aenv-Build-Ids"  # api.routes_builds
TOKEN_PREFIX = "gw1."


def _json(got: Relayed) -> Any:
    return _parsed(got.body)


def _down(skipped: list[Node]) -> dict[str, str]:
    return {"X-Aenv-Nodes-Down": ",".join(n.id for n in skipped)} if skipped else {}


async def _every_node(request: Request, body: bytes | None = None, **kw: Any) -> tuple[list[Relayed], list[Node]] | Response:
    """The request on every live node, in node order; a node that cannot be reached is an error naming it.
    The body is read once, before: concurrent reads of one HTTP/2 request's body wait forever."""
    gw = _gw(request)
    body = await request.body() if body is None else body
    up = sorted(gw.nodes.up(), key=lambda n: n.id)
    if not up:
        return gw.none_up(set())
    results = await asyncio.gather(*(gw.forwarder.send(request, n, body, **kw) for n in up), return_exceptions=True)
    answers = []
    for node, res in zip(up, results, strict=True):
        if not isinstance(res, Relayed):
            return error_response(502, f"node {node.id}: {res}", None, reason="node_failed", node=node.id)
        answers.append(res)
    return answers, gw.nodes.down()


def shared_store(gw: Any) -> str | None:
    """The store every live node shares (build once), else None (replay)."""
    stores = {n.store for n in gw.nodes.up()}
    return stores.pop() if len(stores) == 1 and None not in stores else None


def _known(request: Request, answers: list[Relayed]) -> list[Relayed]:
    """Building once, the nodes that do not know the build (404) are left out while one does."""
    if shared_store(_gw(request)) is None:
        return answers
    return [a for a in answers if a.status != 404] or answers[:1]


async def _accepted_everywhere(request: Request) -> tuple[list[Relayed], list[Node]] | Response:
    """``_every_node``, and the first node's refusal as the answer when one refused."""
    got = await _every_node(request)
    if isinstance(got, Response):
        return got
    answers = _known(request, got[0])
    return _first_refusal(answers) or (answers, got[1])


def _first_refusal(answers: list[Relayed]) -> Response | None:
    for got in answers:
        if got.status >= 300:
            parsed = _json(got)
            message = parsed.get("message") if isinstance(parsed, dict) else None
            return error_response(got.status, f"node {got.node.id}: {message or repr(got.body[:200])}", None,
                                  node=got.node.id)  # fmt: skip
    return None


@router.post("/v3/templates")
async def request_build(request: Request) -> Response:
    gw = _gw(request)
    body = await request.body()
    tried: set[str] = set()
    asked = _parsed(body)
    name = (asked.get("name") or asked.get("alias")) if isinstance(asked, dict) else None
    while (first := gw.place(tried, name if isinstance(name, str) else None, None)) is not None:
        try:
            got = await gw.forwarder.send(request, first, body)
        except NodeUnreachable:
            tried.add(first.id)
            continue
        made = _json(got)
        if got.status != 202 or not isinstance(made, dict) or shared_store(gw) is not None:
            return got.response()  # built once there, published to the store the nodes share
        ids = {BUILD_IDS_HEADER: f"{made['templateID']} {made['buildID']}"}
        others = [n for n in gw.nodes.up() if n is not first]
        results = await asyncio.gather(*(gw.forwarder.send(request, n, body, extra=ids) for n in others),
                                       return_exceptions=True)  # fmt: skip
        answers = [r if isinstance(r, Relayed) else error_response(502, f"node {n.id}: {r}", None, node=n.id)
                   for n, r in zip(others, results, strict=True)]  # fmt: skip
        refused = _first_refusal([a for a in answers if isinstance(a, Relayed)])
        if refused is not None:
            return refused
        if broken := next((a for a in answers if isinstance(a, Response)), None):
            return broken
        return JSONResponse(made, status_code=202, headers=_down(gw.nodes.down()))
    return gw.none_up(tried)


@router.get("/templates/{template_id}/files/{files_hash}")
async def file_link(request: Request, template_id: str, files_hash: str) -> Response:
    got = await _accepted_everywhere(request)
    if isinstance(got, Response):
        return got
    answers, skipped = got
    tokens: dict[str, str] = {}
    base = ""
    for a in answers:
        link = _json(a)
        if isinstance(link, dict) and not link.get("present") and isinstance(url := link.get("url"), str):
            parts = urlsplit(url)  # the node built it from the Host it was sent (the gateway's), with its own
            tokens[a.node.id] = parse_qs(parts.query).get("token", [""])[0]  # scheme: the client's is ours
            base = urlunsplit((request.scope.get("scheme", "http"), parts.netloc, parts.path, "", ""))
    if not tokens:
        return JSONResponse({"present": True}, status_code=201, headers=_down(skipped))
    token = TOKEN_PREFIX + base64.urlsafe_b64encode(json.dumps(tokens).encode()).decode().rstrip("=")
    return JSONResponse({"present": False, "url": f"{base}?{urlencode({'token': token})}"}, status_code=201,
                        headers=_down(skipped))  # fmt: skip


@uploads.put("/aenv/build-files/{files_hash}")
async def upload(request: Request, files_hash: str) -> Response:
    gw = _gw(request)
    raw = request.query_params.get("token", "")
    try:
        body = raw[len(TOKEN_PREFIX):]
        tokens = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))) if raw.startswith(TOKEN_PREFIX) else {}
    except ValueError:
        tokens = {}
    nodes = [gw.nodes.get(str(k)) for k in tokens] if isinstance(tokens, dict) else []
    if not nodes:
        return error_response(404, "no such upload link")
    data = await request.body()
    for node, token in zip(nodes, tokens.values(), strict=True):
        if node is None or not node.up:
            return error_response(503, f"the upload's node {node.id if node else '?'} is down", None, reason="node_down")
        try:
            got = await gw.forwarder.send(request, node, data, query=urlencode({"token": str(token)}))
        except NodeUnreachable as exc:
            return error_response(503, str(exc), None, reason="node_down", node=node.id)
        if got.status >= 300:
            return got.response()
    return Response(status_code=201)


@router.post("/v2/templates/{template_id}/builds/{build_id}")
@router.post("/templates/tags")
@router.delete("/templates/tags")
async def on_every_node(request: Request) -> Response:
    got = await _accepted_everywhere(request)
    if isinstance(got, Response):
        return got
    answers, skipped = got
    out = answers[0].response()
    for k, v in _down(skipped).items():
        out.headers[k] = v
    return out


@router.get("/templates/{template_id}/builds/{build_id}/status")
async def build_status(request: Request, template_id: str, build_id: str) -> Response:
    got = await _every_node(request)
    if isinstance(got, Response):
        return got
    answers, _ = got
    known = [a for a in answers if a.status != 404]  # a node that joined after the build began has none
    if not known:
        return answers[0].response()
    if refused := _first_refusal(known):
        return refused
    states = [(a, _json(a)) for a in known]
    logs = states[0][1]
    if not isinstance(logs, dict):
        return known[0].response()
    out = dict(logs)
    failed = next(((a, s) for a, s in states if isinstance(s, dict) and s.get("status") == "error"), None)
    if failed is not None:
        reason = dict(failed[1].get("reason") or {})
        reason["message"] = f"node {failed[0].node.id}: {reason.get('message', 'the build failed')}"
        out.update(status="error", reason=reason)
    elif all(isinstance(s, dict) and s.get("status") == "ready" for _, s in states):
        out["status"] = "ready"
    else:
        out["status"] = "building"
        out.pop("reason", None)
    return JSONResponse(out)

"""The gateway's control plane: E2B's REST routes, each sent to the node it concerns.

- creates go through placement (``placement.py``): a node that cannot be connected to, or that refuses
  for capacity (429 ``reason: capacity``: nothing was created), is skipped and the next one tried; a
  node with a warm sandbox of the template is preferred; a vm snapshot goes only to nodes of the machine
  it was taken on, once the gateway knows it (``machines.py``: from the answers it relayed, or from a
  node's 409 ``reason: machine``, after which another node of that machine is tried);
- every route about one sandbox (``/sandboxes/{id}/…``, ``/v2/sandboxes/{id}/…``: connect, pause, resume,
  timeout, snapshots, fork, rollback, network, metrics, kill) goes to its owner; fork children and
  snapshots are bound to the node that made them, as the answer names them; a connect or resume of a
  sandbox lost with its node whose pause was published goes to a live node, which adopts it (same id);
- lists fan out to every live node and are merged, page by page (``listing.py``); a node that is down
  is skipped and named in ``X-Aenv-Nodes-Down``, never a failure of the whole list;
- volumes (``volumes.py``): each lives on one node, where its routes go; a create with ``volumeMounts``
  is placed on the node that holds them;
- templates: the nodes share the same ``base``. A build (``builds.py``) runs on one node when the nodes
  share a store (the others fetch it on first use), else is replayed on every live node under the same
  IDs; a pull (``/aenv/templates/pull``) reaches every live node. Lists are merged; a read of one
  template goes to a node that holds it, else to each until one knows it; a delete reaches every live
  node (and leaves the shared store);
- leases (``leases.py``) are made on every live node under one ID; a create bound to one that lands on a
  node without it (down when it was made: 400 ``reason: lease_unknown``) is tried on another node;
- secrets (``secrets.py``): in a cluster, to any one live node (they all hold the same); over a static
  node list, a 501;
- what every node keeps for itself (the image cache, the webhooks' log) is asked of every node and merged
  (``per_node.py``); anything else the gateway does not relay is a 501 that says so.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Callable
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from aenv import __version__
from aenv.api.auth import principal, require_api_key
from aenv.api.errors import error_response
from aenv.gateway import machines, placement, quotas
from aenv.gateway.directory import GatewayError, Locator, OwnerDown
from aenv.gateway.forward import Forwarder, NodeUnreachable, Relayed
from aenv.gateway.listing import Positions, merge_page
from aenv.gateway.nodes import Node, NodeSet
from aenv.gateway.volumes import mount_home
from aenv.machine_key import MachineKey
from aenv.teams import TeamDirectory

log = logging.getLogger("aenv.gateway")

DOWN_HEADER = "X-Aenv-Nodes-Down"  # on merged answers: the nodes that were skipped
ALL = ["GET", "POST", "PUT", "PATCH", "DELETE"]
DEFAULT_LIMIT = 100  # a node's own page size when a list names none

router = APIRouter(dependencies=[Depends(require_api_key)])


class Gateway:
    """What the routes share: nodes, bindings, the forwarder and the placement's random source."""

    def __init__(self, nodes: NodeSet, locator: Locator, forwarder: Forwarder, rng: random.Random | None = None) -> None:
        self.nodes = nodes
        self.locator = locator
        self.forwarder = forwarder
        self.rng = rng or random.Random()
        self.on_created: list[Callable[[str], None]] = []  # a sandbox made through this gateway (create, fork)
        self.machines = machines.SnapshotMachines()  # the machine a snapshot restores on, where known
        self.teams: TeamDirectory | None = None  # team quotas across the nodes (quotas.py); None: not checked
        self.shared_secrets = False  # the nodes keep the secrets in one Redis (cluster mode; secrets.py)

    # ---- creates ----------------------------------------------------------------------------
    def place(self, exclude: set[str], template: str | None, key: str | None, pinned: Node | None = None,
              machine: MachineKey | None = None) -> Node | None:  # fmt: skip
        """Where a create goes, among live nodes not in ``exclude`` and of ``machine`` (a vm snapshot's)."""
        if pinned is not None:  # where the create's volumes are: that node or none
            return pinned if pinned.up and pinned.id not in exclude and machines.fits(machine, pinned) else None
        candidates = [n for n in self.nodes.up() if n.id not in exclude and machines.fits(machine, n)]
        if not candidates:
            return None
        home = self.locator.snapshot_home(template) if template else None
        if home is not None and home in candidates:
            return home  # create-from-snapshot where the snapshot's files are
        pairs = [(n.id, n.load) for n in candidates]
        if key:
            return self.nodes.nodes[placement.by_key(pairs, key)]
        warm = {n.id for n in candidates if n.warm_for(template)}
        cached = {n.id for n in candidates if n.holds(template)}
        return self.nodes.nodes[placement.best_of_k(pairs, self.rng, warm=warm, cached=cached)]

    async def create(self, request: Request) -> Response:
        body = await request.body()
        team = principal(request).team
        if self.teams is not None and (over := quotas.check(self.teams, team, self.nodes.up())) is not None:
            return over  # the team's total across the nodes (each node also checks its own share)
        template = _field(body, "templateID")
        key = request.headers.get("idempotency-key")
        pinned = await mount_home(self, request, body)
        if isinstance(pinned, Response):
            return pinned
        tried: set[str] = set()
        machine = self.machines.get(template)
        while (node := self.place(tried, template, key, pinned, machine)) is not None:
            node.inflight += 1
            try:
                got = await self.forwarder.send(request, node, body)
            except NodeUnreachable:
                tried.add(node.id)
                continue
            finally:
                node.inflight -= 1
            if machines.is_refusal(got.status, refusal := _parsed(got.body)):
                # a vm snapshot of another machine than this node's: nothing started; one of its machine
                log.info("node=%s cannot restore %s (another machine); trying a node of its machine", node.id, template)
                machine = self.machines.learn_refusal(template, refusal) or machine
                tried.add(node.id)
                continue
            if got.status == 429 and _field(got.body, "reason") == "capacity" and self.place(tried | {node.id}, None, None,
                                                                                          pinned, machine):
                log.info("node=%s refused a create for capacity; trying another node", node.id)
                tried.add(node.id)
                continue
            if got.status == 400 and _field(got.body, "reason") == "lease_unknown" and self.place(
                    tried | {node.id}, None, None, pinned, machine):
                log.info("node=%s does not hold the create's lease (down when it was made); trying another", node.id)
                tried.add(node.id)
                continue
            if got.status == 404 and template and pinned is None and self.locator.snapshot_home(template) is None:
                # Not a template this node has: a snapshot taken on another node, made before this gateway
                # relayed it (or before it restarted)? Its node is asked; placement then follows it.
                home = await self._snapshot_home(template)
                if home is not None and home is not node and home.id not in tried:
                    tried.add(node.id)
                    continue
            if got.status in (200, 201) and (sid := _field(got.body, "sandboxID")):
                self.learn(_parsed(got.body), node)
                node.placed += 1
                node.placed_by_team[team] = node.placed_by_team.get(team, 0) + 1
                self.created(sid)
            return got.response()
        if machine is not None and (live := self.nodes.up()):
            return machines.none_fits(f"snapshot '{template}'", machine, live)
        return self.none_up(tried)

    def learn(self, sandbox: Any, node: Node) -> None:
        """Bind a sandbox an answer describes to the node that gave it, and keep its envd token (signed
        file URLs name no sandbox: the token tells whose they are)."""
        if not isinstance(sandbox, dict) or not isinstance(sid := sandbox.get("sandboxID"), str):
            return
        self.locator.remember(sid, node.id)
        if isinstance(token := sandbox.get("envdAccessToken"), str) and token:
            self.locator.remember_token(sid, token)

    async def _snapshot_home(self, snapshot_id: str) -> Node | None:
        try:
            return await self.locator.snapshot_owner(snapshot_id)
        except GatewayError:
            return None

    def created(self, sandbox_id: str) -> None:
        for hook in self.on_created:
            hook(sandbox_id)

    def none_up(self, tried: set[str]) -> JSONResponse:
        why = "; ".join(f"{n.id} {n.url}: {n.reason or 'refused'}" for n in self.nodes.nodes.values())
        message = f"no node can take this create ({why})"
        return error_response(503, message, {"Retry-After": "1"}, reason="no_node")

    # ---- one sandbox --------------------------------------------------------------------------
    async def to_owner(self, request: Request, sandbox_id: str) -> Relayed | Response:
        try:
            node = await self.locator.owner(sandbox_id)
            return await self.forwarder.send(request, node)
        except GatewayError as exc:
            return _located_error(exc)
        except NodeUnreachable as exc:
            return _located_error(GatewayError(str(exc), exc.node), reason="node_down")

    async def connect(self, request: Request, sandbox_id: str) -> Response:
        """connect/resume: to the owner; when it is down and the sandbox's pause is published (its
        binding says lost and published), on a live node instead, under the same id (``adopt``)."""
        try:
            node = await self.locator.owner(sandbox_id)
            got = await self.forwarder.send(request, node)
        except OwnerDown as exc:
            return await self.adopt(request, sandbox_id, exc)
        except GatewayError as exc:
            return _located_error(exc)
        except NodeUnreachable as exc:
            return await self.adopt(request, sandbox_id, GatewayError(str(exc), exc.node), "node_down")
        if got.status in (200, 201):
            self.learn(_parsed(got.body), got.node)  # a connect answer carries the envd token
        return got.response()

    async def adopt(self, request: Request, sandbox_id: str, down: GatewayError, reason: str | None = None) -> Response:
        """A sandbox lost with its node, resumed on another from its published pause (the node's
        ``POST /aenv/sandboxes/{id}/adopt``, which takes the binding over, fenced); else the 404."""
        if not await self.locator.published(sandbox_id):
            return _located_error(down, reason)
        body = await request.body()
        tried = {down.node.id} if down.node is not None else set()
        machine = self.machines.get(sandbox_id)  # its published pause's, once a node said
        while (node := self.place(tried, None, None, machine=machine)) is not None:
            node.inflight += 1
            try:
                got = await self.forwarder.send(request, node, body, path=f"/aenv/sandboxes/{sandbox_id}/adopt")
            except NodeUnreachable:
                tried.add(node.id)
                continue
            finally:
                node.inflight -= 1
            if machines.is_refusal(got.status, refusal := _parsed(got.body)):
                machine = self.machines.learn_refusal(sandbox_id, refusal) or machine
                tried.add(node.id)
                continue
            if got.status in (200, 201):
                self.learn(_parsed(got.body), node)
                log.info("sandbox=%s lost on node %s: resumed on node %s from its published pause", sandbox_id,
                         down.node.id if down.node else "?", node.id)  # fmt: skip
                self.created(sandbox_id)
            elif got.status == 409 and (owner := await self._new_owner(sandbox_id, node)) is not None:
                return (await self.forwarder.send(request, owner, body)).response()  # adopted there first
            return got.response()
        if machine is not None and (live := self.nodes.up()):
            return machines.none_fits(f"the published pause of sandbox '{sandbox_id}'", machine, live)
        return _located_error(down, reason)

    async def _new_owner(self, sandbox_id: str, refused: Node) -> Node | None:
        """After a refused adoption: the live node another connect (through another gateway, say) had it
        adopted by first, if the directory now binds it to one."""
        self.locator.forget(sandbox_id)
        try:
            owner = await self.locator.owner(sandbox_id)
        except GatewayError:
            return None
        return owner if owner is not refused else None

    # ---- every node ---------------------------------------------------------------------------
    async def fan_out(self, request: Request) -> tuple[list[Relayed], list[Node]]:
        """The request sent to every live node at once: their answers, and the nodes skipped."""
        up, skipped = self.nodes.up(), self.nodes.down()
        results = await asyncio.gather(*(self.forwarder.send(request, n, b"") for n in up), return_exceptions=True)
        answers: list[Relayed] = []
        for node, res in zip(up, results, strict=True):
            if isinstance(res, Relayed):
                answers.append(res)
            else:
                log.warning("node=%s skipped in %s %s: %r", node.id, request.method, request.url.path, res)
                skipped.append(node)
        return answers, skipped

    async def merged_list(self, request: Request, keys: tuple[str, str], paged: bool) -> Response:
        """Every live node's list, merged; ``paged``: one page (``limit``, ``nextToken``) across the nodes."""
        if not paged:
            answers, skipped = await self.fan_out(request)
            for got in answers:
                if got.status != 200:
                    return got.response()  # a bad filter is bad on every node
            items = [item for got in answers for item in json.loads(got.body)]
            items.sort(key=lambda s: str(s.get(keys[0], "")), reverse=True)
            return JSONResponse(items, headers=_down_headers(skipped))
        try:
            before = Positions.decode(request.query_params.get("nextToken"))
        except ValueError as exc:
            return error_response(400, f"nextToken: {exc}")
        limit_raw = request.query_params.get("limit", "")
        limit = int(limit_raw) if limit_raw.isdigit() else DEFAULT_LIMIT
        params = [(k, v) for k, v in request.query_params.multi_items() if k not in ("nextToken", "node")]
        up, skipped = [n for n in self.nodes.up() if n.id not in before.done], self.nodes.down()
        if only := request.query_params.get("node"):  # aenv: one node's sandboxes (the console's filter)
            up, skipped = [n for n in up if n.id == only], [n for n in skipped if n.id == only]

        def query(node: Node) -> str:
            after = before.after.get(node.id)
            return urlencode(params + ([("nextToken", after)] if after else []))

        results = await asyncio.gather(*(self.forwarder.send(request, n, b"", query=query(n)) for n in up),
                                       return_exceptions=True)  # fmt: skip
        pages: dict[str, tuple[list[Any], bool]] = {}
        for node, res in zip(up, results, strict=True):
            if not isinstance(res, Relayed):
                log.warning("node=%s skipped in %s %s: %r", node.id, request.method, request.url.path, res)
                skipped.append(node)
            elif res.status != 200:
                return res.response()  # a bad filter is bad on every node
            else:
                items = [{**item, "node": node.id} for item in json.loads(res.body)]  # aenv: where it runs
                pages[node.id] = (items, any(k == "x-next-token" for k, _ in res.headers))
        descending = request.query_params.get("order") != "asc"
        items, after = merge_page(pages, before, keys, descending, limit)
        headers = _down_headers(skipped) or {}
        if any(n not in after.done for n in pages):
            headers["X-Next-Token"] = after.encode()
        return JSONResponse(items, headers=headers)


def gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


def _parsed(body: bytes) -> Any:
    """A node's JSON answer, or None when it is not JSON (the gateway learns nothing from it)."""
    try:
        return json.loads(body) if body else None
    except ValueError:
        return None


def _field(body: bytes, name: str) -> str | None:
    parsed = _parsed(body)
    value = parsed.get(name) if isinstance(parsed, dict) else None
    return value if isinstance(value, str) else None


def _located_error(exc: GatewayError, reason: str | None = None) -> JSONResponse:
    extra: dict[str, str] = {"node": exc.node.id} if exc.node is not None else {}
    if why := reason or exc.reason:
        extra["reason"] = why
    return error_response(404, exc.message, None, **extra)


def _down_headers(skipped: list[Node]) -> dict[str, str] | None:
    return {DOWN_HEADER: ",".join(n.id for n in skipped)} if skipped else None


def _relay(got: Relayed | Response) -> Response:
    return got.response() if isinstance(got, Relayed) else got


# ---- routes: creates and lists ------------------------------------------------------------------
@router.post("/sandboxes")
@router.post("/v2/sandboxes")
@router.post("/sandboxes-compose")  # a compose sandbox is placed like any create (core/compose.py on the node)
async def create(request: Request) -> Response:
    return await gateway(request).create(request)


@router.get("/sandboxes")
@router.get("/v2/sandboxes")
async def list_sandboxes(request: Request) -> Response:
    return await gateway(request).merged_list(request, ("startedAt", "sandboxID"), request.url.path.startswith("/v2/"))


@router.get("/snapshots")
async def list_snapshots(request: Request) -> Response:
    return await gateway(request).merged_list(request, ("createdAt", "snapshotID"), True)


# ---- routes: one sandbox -------------------------------------------------------------------------
@router.post("/sandboxes/{sandbox_id}/fork")
async def fork(request: Request, sandbox_id: str) -> Response:
    gw = gateway(request)
    got = await gw.to_owner(request, sandbox_id)
    if isinstance(got, Relayed) and got.status in (200, 201):
        children = _parsed(got.body)
        for child in children if isinstance(children, list) else []:
            if isinstance(child, dict) and isinstance(kid := child.get("sandbox"), dict) and kid.get("sandboxID"):
                gw.learn(kid, got.node)
                gw.created(kid["sandboxID"])
    return _relay(got)


@router.post("/sandboxes/{sandbox_id}/snapshots")
async def snapshot(request: Request, sandbox_id: str) -> Response:
    gw = gateway(request)
    got = await gw.to_owner(request, sandbox_id)
    if isinstance(got, Relayed) and got.status in (200, 201) and (snap := _field(got.body, "snapshotID")):
        gw.locator.remember_snapshot(snap, got.node.id)
        gw.machines.learn_snapshot(_parsed(got.body))
    return _relay(got)


@router.get("/sandboxes/metrics")  # before /sandboxes/{sandbox_id}, which would take "metrics" for an ID
async def batch_metrics(request: Request) -> Response:
    """E2B's batch metrics: every live node answers for the sandboxes it holds; the maps are merged."""
    gw = gateway(request)
    up, skipped = gw.nodes.up(), gw.nodes.down()
    results = await asyncio.gather(*(gw.forwarder.send(request, n) for n in up), return_exceptions=True)
    merged: dict[str, Any] = {}
    for node, res in zip(up, results, strict=True):
        if not isinstance(res, Relayed):
            skipped.append(node)
        elif res.status != 200:
            return res.response()  # the request's own fault (a 400): every node says the same
        else:
            merged.update((_parsed(res.body) or {}).get("sandboxes", {}))
    return JSONResponse({"sandboxes": merged}, headers=_down_headers(skipped))


@router.api_route("/sandboxes/{sandbox_id}", methods=ALL)
@router.api_route("/sandboxes/{sandbox_id}/{rest:path}", methods=ALL)
@router.api_route("/v2/sandboxes/{sandbox_id}/{rest:path}", methods=ALL)
@router.api_route("/unstable/sandboxes/{sandbox_id}/{rest:path}", methods=ALL)
async def sandbox_scoped(request: Request, sandbox_id: str, rest: str = "") -> Response:
    gw = gateway(request)
    if rest in ("connect", "resume") and request.method == "POST":
        return await gw.connect(request, sandbox_id)
    return _relay(await gw.to_owner(request, sandbox_id))


@router.api_route("/snapshots/{snapshot_id}", methods=ALL)
async def snapshot_scoped(request: Request, snapshot_id: str) -> Response:
    gw = gateway(request)
    try:
        node = await gw.locator.snapshot_owner(snapshot_id)
        got = await gw.forwarder.send(request, node)
        if request.method == "GET" and got.status == 200:
            gw.machines.learn_snapshot(_parsed(got.body))
        return got.response()
    except GatewayError as exc:
        return _located_error(exc)
    except NodeUnreachable as exc:
        return _located_error(GatewayError(str(exc), exc.node), reason="node_down")


# ---- routes: every node ----------------------------------------------------------------------------
@router.post("/aenv/sandboxes/kill")
@router.delete("/aenv/sandboxes")
async def kill_matching(request: Request) -> Response:
    """Reaping by metadata reaches every live node; the report is the union (and names the nodes skipped)."""
    gw = gateway(request)
    body = await request.body()
    up, skipped = gw.nodes.up(), gw.nodes.down()
    results = await asyncio.gather(*(gw.forwarder.send(request, n, body) for n in up), return_exceptions=True)
    killed: list[str] = []
    failed: list[Any] = []
    for node, res in zip(up, results, strict=True):
        if not isinstance(res, Relayed):
            skipped.append(node)
        elif res.status != 200:
            return res.response()
        else:
            report = json.loads(res.body)
            killed += report.get("killed", [])
            failed += report.get("failed", [])
    return JSONResponse({"killed": sorted(killed), "failed": failed, "nodesDown": [n.id for n in skipped]},
                        headers=_down_headers(skipped))


# ---- routes: templates (shared by the nodes) --------------------------------------------------------
@router.get("/templates")
@router.get("/v2/templates")
@router.get("/templates/{rest:path}")
@router.get("/default-templates")
async def template_read(request: Request) -> Response:
    """A list is every live node's, merged (a template built once is on its building node, and on
    those that fetched it); a read of one template goes to a node that holds it, else one after
    another until one knows it (any node fetches a built template from the shared store on first use)."""
    gw = gateway(request)
    if request.url.path in ("/templates", "/v2/templates"):
        return await _merged_templates(gw, request)
    template = request.path_params.get("rest", "").split("/")[0] or None
    unknown: Relayed | None = None
    for node in sorted(gw.nodes.up(), key=lambda n: (not n.holds(template), n.load)):
        try:
            got = await gw.forwarder.send(request, node)
        except NodeUnreachable:
            continue
        if got.status != 404 or request.method != "GET":
            return got.response()
        unknown = unknown or got
    return unknown.response() if unknown is not None else gw.none_up(set())


async def _merged_templates(gw: Gateway, request: Request) -> Response:
    answers, skipped = await gw.fan_out(request)
    merged: dict[str, Any] = {}
    for got in sorted(answers, key=lambda a: a.node.id):
        if got.status != 200:
            return got.response()
        for item in _parsed(got.body) or []:
            if isinstance(item, dict):
                merged.setdefault(str(item.get("templateID")), item)
    return JSONResponse(list(merged.values()), headers=_down_headers(skipped))


@router.delete("/templates/{template_id:path}")
async def template_delete(request: Request, template_id: str) -> Response:
    """A snapshot's template lives on the snapshot's node: its delete goes there. Any other template is
    deleted on every live node that has it, and a built one leaves the shared store too (each node
    takes out what it has; one that never fetched it takes it out of the store). 204 when some node
    deleted it, a node's refusal (409: in use there) as it came, else the 404; nodes that were down
    are named in ``X-Aenv-Nodes-Down`` (they keep their copy)."""
    gw = gateway(request)
    try:
        node = await gw.locator.snapshot_owner(template_id)
    except OwnerDown as exc:
        return _located_error(exc)
    except GatewayError:
        return await _delete_everywhere(gw, request)
    got = await gw.forwarder.send(request, node)
    # another team's snapshot: its node says unknown, and so does the gateway, as for any unknown name
    return await _delete_everywhere(gw, request) if got.plain_not_found() else got.response()


async def _delete_everywhere(gw: Gateway, request: Request) -> Response:
    answers, skipped = await gw.fan_out(request)
    if not answers:
        return gw.none_up(set())
    if refused := next((a for a in answers if a.status >= 300 and a.status != 404), None):
        return refused.response()
    if any(a.status < 300 for a in answers):
        return Response(status_code=204, headers=_down_headers(skipped))
    return answers[0].response()


@router.post("/aenv/templates/pull")
async def template_pull(request: Request) -> Response:
    """A pull reaches every live node at once (each fetches the image; layers come from the registry or
    its mirror). The answer is one node's progress and, last, one line: the template when every node
    has it (``nodes`` lists them), else an error naming each node that failed. Nodes that are down are
    named in ``X-Aenv-Nodes-Down``: pull again there once they are back."""
    gw = gateway(request)
    body = await request.body()
    up, skipped = gw.nodes.up(), gw.nodes.down()
    if not up:
        return gw.none_up(set())
    results = await asyncio.gather(*(gw.forwarder.send(request, n, body) for n in up), return_exceptions=True)
    events: list[bytes] = []
    done: list[tuple[Node, Any]] = []
    failed: list[str] = []
    for node, res in zip(up, results, strict=True):
        if not isinstance(res, Relayed):
            failed.append(f"node {node.id}: {res}")
            continue
        if res.status != 200:
            failed.append(f"node {node.id}: {res.status} {_field(res.body, 'message') or res.body[:200]!r}")
            continue
        lines = [ln for ln in res.body.splitlines() if ln.strip()]
        last = _parsed(lines[-1]) if lines else None
        if isinstance(last, dict) and "template" in last:
            done.append((node, last))
            events = events or lines[:-1]
        else:
            err = last.get("error") if isinstance(last, dict) else None
            failed.append(f"node {node.id}: {err.get('message') if isinstance(err, dict) else 'no answer'}")
    if failed:
        final: dict[str, Any] = {"error": {"code": 502, "message": "the pull failed on " + "; ".join(failed)
                                           + (f" (it succeeded on {', '.join(n.id for n, _ in done)})" if done else "")}}
    else:
        final = {**done[0][1], "nodes": [n.id for n, _ in done]}
    out = b"\n".join([*events, json.dumps(final).encode()]) + b"\n"
    return Response(out, media_type="application/x-ndjson", headers=_down_headers(skipped))


@router.post("/v3/templates")
@router.post("/v2/templates/{rest:path}")
@router.api_route("/templates/{rest:path}", methods=["POST", "DELETE", "PUT", "PATCH"])
async def template_write(request: Request) -> Response:
    return _template_refusal(request)


def _template_refusal(request: Request) -> Response:
    urls = " ".join(n.url for n in gateway(request).nodes.nodes.values())
    return error_response(
        501, "the gateway does not change templates this way (builds, tags and deletes go through it): "
             f"run it against each node (aenv --server URL ...; nodes: {urls})", None, reason="gateway")


# ---- routes: the gateway itself -------------------------------------------------------------------
@router.get("/nodes")
async def list_nodes(request: Request) -> JSONResponse:
    return JSONResponse([n.describe() for n in gateway(request).nodes.nodes.values()])


@router.get("/nodes/{node_id}")
async def get_node(request: Request, node_id: str) -> JSONResponse:
    node = gateway(request).nodes.get(node_id)
    if node is None:
        return error_response(404, f"node '{node_id}' not found")
    return JSONResponse(node.describe())


@router.get("/aenv/info")
async def info(request: Request) -> JSONResponse:
    nodes = gateway(request).nodes
    counts: dict[str, int] = {}
    for n in nodes.up():
        for state, k in n.counts.items():
            counts[state] = counts.get(state, 0) + k
    runtimes = {n.runtime for n in nodes.up()}
    return JSONResponse({
        "version": __version__, "role": "gateway", "sandboxes": counts,
        "starting": sum(n.starting for n in nodes.up()), "runtime": runtimes.pop() if len(runtimes) == 1 else None,
        "nodes": [n.describe() for n in nodes.nodes.values()],
    })  # fmt: skip


@router.api_route("/{rest:path}", methods=ALL)
async def not_relayed(request: Request) -> JSONResponse:
    return error_response(
        501, f"the gateway does not relay {request.method} {request.url.path}: call the node itself", None,
        reason="gateway")

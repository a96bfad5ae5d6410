"""Volumes through the gateway: a create with ``volumeMounts`` goes to the node that holds them (volumes
on two nodes are a 400, on a node that is down a 503, both naming the nodes); a volume's routes go to its
node; a new volume is bound to the node that made it."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace
from typing import Any

import httpx
from starlette.requests import Request

from aenv.gateway import volumes
from aenv.gateway.control import Gateway
from aenv.gateway.directory import Locator
from aenv.gateway.forward import Relayed
from aenv.gateway.nodes import Node, NodeSet
from aenv.teams import Principal


class VolumeDirectory:
    """Volume names (any owner) and ids to nodes."""

    def __init__(self, names: dict[str, str], ids: dict[str, str]) -> None:
        self.names = names
        self.ids = ids
        self.owners: list[str] = []

    async def find_sandbox(self, sandbox_id: str) -> str | None:
        return None

    async def find_snapshot(self, snapshot_id: str) -> str | None:
        return None

    async def find_volume(self, volume_id: str, path: str, headers: dict[str, str]) -> str | None:
        return self.ids.get(volume_id)

    async def find_volume_named(self, name: str, owner: str, headers: dict[str, str]) -> str | None:
        self.owners.append(owner)
        return self.names.get(name)


class Recorder:
    """A forwarder that answers (status, body) for every node and records where requests went."""

    def __init__(self, answer: tuple[int, Any]) -> None:
        self.answer = answer
        self.sent: list[tuple[str, str]] = []

    async def send(self, request: Request, node: Node, body: bytes | None = None, **_: Any) -> Relayed:
        self.sent.append((node.id, request.url.path))
        status, payload = self.answer
        data = json.dumps(payload).encode() if payload is not None else b""
        return Relayed(status, [("content-type", "application/json")], data, node)

    async def stream(self, scope: Any, receive: Any, send: Any, node: Node) -> None:
        self.sent.append((node.id, scope["path"]))


async def _no_send(message: Any) -> None:
    raise AssertionError("the fake stream answers nothing")


def _setup(names: dict[str, str], ids: dict[str, str] | None = None,
           answer: tuple[int, Any] = (201, {"sandboxID": "s1"})) -> tuple[Gateway, Recorder]:  # fmt: skip
    nodes = NodeSet([Node(f"n{i}", f"http://h:{i}", "h", i) for i in (1, 2, 3)], httpx.AsyncClient(), None)
    for i, n in enumerate(nodes.nodes.values()):
        n.up, n.counts = True, {"running": i}  # n1 is the emptiest
    fwd = Recorder(answer)
    gw = Gateway(nodes, Locator(nodes, VolumeDirectory(names, ids or {})), fwd, random.Random(0))  # type: ignore[arg-type]
    return gw, fwd


def _request(gw: Gateway, method: str, path: str, body: Any = None) -> Request:
    data = json.dumps(body).encode() if body is not None else b""

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": data, "more_body": False}

    scope = {"type": "http", "method": method, "path": path, "headers": [(b"x-api-key", b"k1")], "query_string": b"",
             "app": SimpleNamespace(state=SimpleNamespace(gateway=gw)),
             "state": {"principal": Principal("team-k1")}}  # what require_api_key leaves for the key  # fmt: skip
    return Request(scope, receive)


def _body(r: Any) -> Any:
    return json.loads(bytes(r.body))


async def test_a_create_goes_where_its_volumes_are() -> None:
    gw, fwd = _setup({"data": "n3", "ckpt": "n3"})
    mounts = [{"name": "data", "path": "/data"}, {"name": "ckpt:ro", "path": "/ckpt"}]
    r = await gw.create(_request(gw, "POST", "/v2/sandboxes", {"templateID": "base", "volumeMounts": mounts}))
    assert r.status_code == 201 and fwd.sent == [("n3", "/v2/sandboxes")]
    assert gw.locator._directory.owners == ["team-k1", "team-k1"]  # type: ignore[attr-defined]  # by the key's team


async def test_a_create_without_known_volumes_is_placed_as_any() -> None:
    gw, fwd = _setup({})
    r = await gw.create(_request(gw, "POST", "/v2/sandboxes", {"volumeMounts": [{"name": "nope", "path": "/x"}]}))
    assert r.status_code == 201 and fwd.sent == [("n1", "/v2/sandboxes")]  # its node answers for the name


async def test_volumes_on_two_nodes_are_a_400_naming_them() -> None:
    gw, fwd = _setup({"a": "n1", "b": "n2"})
    r = await gw.create(_request(gw, "POST", "/v2/sandboxes",
                                 {"volumeMounts": [{"name": "a", "path": "/a"}, {"name": "b", "path": "/b"}]}))
    body = _body(r)
    assert r.status_code == 400 and body["reason"] == "volumes_split" and fwd.sent == []
    assert "'a' on node n1" in body["message"] and "'b' on node n2" in body["message"]


async def test_volumes_on_a_node_that_is_down_are_a_503_naming_it() -> None:
    gw, fwd = _setup({"a": "n2"})
    gw.nodes.mark_down(gw.nodes.nodes["n2"], "refused")
    r = await gw.create(_request(gw, "POST", "/v2/sandboxes", {"volumeMounts": [{"name": "a", "path": "/a"}]}))
    body = _body(r)
    assert (r.status_code, body["reason"], body["node"]) == (503, "node_down", "n2") and fwd.sent == []
    assert "volume 'a' is on node n2 (http://h:2), which is down" in body["message"]


async def test_a_new_volume_is_bound_to_its_node_and_its_routes_follow() -> None:
    gw, fwd = _setup({}, answer=(201, {"volumeID": "v1", "name": "data", "token": "t"}))
    r = await volumes.create_volume(_request(gw, "POST", "/volumes", {"name": "data"}))
    assert r.status_code == 201 and fwd.sent == [("n1", "/volumes")]
    gw.nodes.nodes["n1"].counts = {"running": 9}  # placement would pick another node now: the volume stays
    req = _request(gw, "GET", "/volumecontent/v1/path")
    await volumes.relay_content(gw.locator, fwd, req.scope, req.receive, _no_send)  # type: ignore[arg-type]
    assert fwd.sent[-1] == ("n1", "/volumecontent/v1/path")  # streamed there
    sent: list[Any] = []

    async def keep(message: Any) -> None:
        sent.append(message)

    await volumes.relay_content(gw.locator, fwd, {**req.scope, "path": "/volumecontent/v9/file"}, req.receive, keep)
    assert sent[0]["status"] == 404 and b"volume 'v9' not found" in sent[1]["body"]


async def test_a_volume_name_held_on_a_node_sends_its_create_there() -> None:
    gw, fwd = _setup({"data": "n2"}, answer=(409, {"code": 409, "message": "a volume named 'data' already exists"}))
    r = await volumes.create_volume(_request(gw, "POST", "/volumes", {"name": "data"}))
    assert r.status_code == 409 and fwd.sent == [("n2", "/volumes")]


async def test_a_volume_on_a_node_that_is_down_is_a_503_and_an_unknown_one_a_404() -> None:
    gw, fwd = _setup({}, {"v1": "n3"}, answer=(200, {}))
    gw.nodes.mark_down(gw.nodes.nodes["n3"], "refused")
    r = await volumes.volume_scoped(_request(gw, "GET", "/volumes/v1"), "v1")
    assert (r.status_code, _body(r)["node"]) == (503, "n3") and "volume 'v1' is on node n3" in _body(r)["message"]
    r = await volumes.volume_scoped(_request(gw, "GET", "/volumes/v9"), "v9")
    assert r.status_code == 404 and "node n3" in _body(r)["message"]  # the nodes not asked are named
    assert fwd.sent == []


async def test_the_list_merges_live_nodes_and_names_those_down() -> None:
    gw, fwd = _setup({}, answer=(200, [{"volumeID": "v", "name": "x"}]))
    gw.nodes.mark_down(gw.nodes.nodes["n2"], "refused")
    r = await volumes.list_volumes(_request(gw, "GET", "/volumes"))
    assert r.status_code == 200 and len(_body(r)) == 2 and r.headers["x-aenv-nodes-down"] == "n2"

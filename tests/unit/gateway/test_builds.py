"""Template builds through the gateway: the request reaches every node under the first node's IDs, the
upload link carries each node's token and its PUT reaches each, and the status is merged."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any
from urllib.parse import parse_qs, urlsplit

from starlette.requests import Request

from aenv.gateway import builds
from aenv.gateway.control import Gateway
from aenv.gateway.forward import Relayed
from aenv.gateway.nodes import Node
from tests.unit.gateway.test_volumes import _request, _setup


class PerNode:
    """A forwarder answering per node (status, body); records (node, path, query, extra headers)."""

    def __init__(self, answers: dict[str, tuple[int, Any]]) -> None:
        self.answers = answers
        self.sent: list[tuple[str, str, str | None, dict[str, str] | None]] = []

    async def send(self, request: Request, node: Node, body: bytes | None = None, path: str | None = None,
                   query: str | None = None, extra: dict[str, str] | None = None) -> Relayed:  # fmt: skip
        self.sent.append((node.id, request.url.path, query, extra))
        status, payload = self.answers[node.id]
        return Relayed(status, [("content-type", "application/json")], json.dumps(payload).encode(), node)


def _gw(answers: dict[str, tuple[int, Any]]) -> tuple[Gateway, PerNode]:
    gw, _ = _setup({})
    fwd = PerNode(answers)
    gw.forwarder = fwd  # type: ignore[assignment]
    return gw, fwd


async def test_the_request_reaches_every_node_under_the_first_ones_ids() -> None:
    made = (202, {"templateID": "t1", "buildID": "b1"})
    gw, fwd = _gw({"n1": made, "n2": made, "n3": made})
    r = await builds.request_build(_request(gw, "POST", "/v3/templates", {"name": "x"}))
    assert r.status_code == 202 and json.loads(bytes(r.body))["templateID"] == "t1"
    assert fwd.sent[0][0] == "n1" and fwd.sent[0][3] is None  # placed: the emptiest
    assert sorted((n, e) for n, _, _, e in fwd.sent[1:]) == [("n2", {"X-Aenv-Build-Ids": "t1 b1"}),
                                                            ("n3", {"X-Aenv-Build-Ids": "t1 b1"})]  # fmt: skip


async def test_a_node_that_refuses_the_request_is_named() -> None:
    gw, _ = _gw({"n1": (202, {"templateID": "t1", "buildID": "b1"}), "n2": (409, {"message": "has the ID t9"}),
                 "n3": (202, {})})  # fmt: skip
    r = await builds.request_build(_request(gw, "POST", "/v3/templates", {"name": "x"}))
    assert r.status_code == 409 and json.loads(bytes(r.body))["message"] == "node n2: has the ID t9"


async def test_the_upload_link_carries_each_nodes_token_and_reaches_each() -> None:
    link = "http://gw:1/aenv/build-files/" + "a" * 64
    gw, fwd = _gw({"n1": (201, {"present": False, "url": link + "?token=tok1"}), "n2": (201, {"present": True}),
                   "n3": (201, {"present": False, "url": link + "?token=tok3"})})  # fmt: skip
    r = await builds.file_link(_request(gw, "GET", "/templates/t1/files/" + "a" * 64), "t1", "a" * 64)
    url = json.loads(bytes(r.body))["url"]
    assert url.startswith(link + "?token=gw1.")
    https = _request(gw, "GET", "/templates/t1/files/" + "a" * 64)
    https.scope["scheme"] = "https"  # behind an HTTPS gateway the plain-HTTP nodes' links say http
    secure = json.loads(bytes((await builds.file_link(https, "t1", "a" * 64)).body))["url"]
    assert secure.startswith("https://gw:1/aenv/build-files/")
    token = parse_qs(urlsplit(url).query)["token"][0]
    fwd.answers = {n: (201, {}) for n in ("n1", "n2", "n3")}
    fwd.sent.clear()
    req = _request(gw, "PUT", "/aenv/build-files/" + "a" * 64)
    req.scope["query_string"] = f"token={token}".encode()
    r = await builds.upload(req, "a" * 64)
    assert r.status_code == 201
    assert [(n, q) for n, _, q, _ in fwd.sent] == [("n1", "token=tok1"), ("n3", "token=tok3")]


async def test_every_node_present_is_present() -> None:
    gw, _ = _gw({n: (201, {"present": True}) for n in ("n1", "n2", "n3")})
    r = await builds.file_link(_request(gw, "GET", "/templates/t1/files/x"), "t1", "x")
    assert json.loads(bytes(r.body)) == {"present": True}


def _status(s: str, logs: int = 0, **extra: Any) -> tuple[int, Any]:
    return 200, {"templateID": "t1", "buildID": "b1", "status": s, "logEntries": [{"message": "m"}] * logs, **extra}


async def test_the_status_is_ready_only_when_every_node_is() -> None:
    gw, _ = _gw({"n1": _status("ready", 2), "n2": _status("building"), "n3": _status("ready")})
    req = _request(gw, "GET", "/templates/t1/builds/b1/status")
    r = await builds.build_status(req, "t1", "b1")
    body = json.loads(bytes(r.body))
    assert body["status"] == "building" and len(body["logEntries"]) == 2  # n1's logs
    gw.forwarder.answers["n2"] = _status("ready")  # type: ignore[attr-defined]
    body = json.loads(bytes((await builds.build_status(req, "t1", "b1")).body))
    assert body["status"] == "ready"


async def test_a_failed_node_fails_the_status_naming_it() -> None:
    gw, _ = _gw({"n1": _status("building"), "n2": _status("error", reason={"message": "step 2 failed", "step": "2"}),
                 "n3": (404, {"message": "no such build"})})  # fmt: skip
    body = json.loads(bytes((await builds.build_status(_request(gw, "GET", "/s"), "t1", "b1")).body))
    assert body["status"] == "error" and body["reason"] == {"message": "node n2: step 2 failed", "step": "2"}


async def test_every_node_gets_the_body_read_once() -> None:
    """An HTTP/2 request's body read by several relays at once waits forever (seen: a build's start
    through an HTTPS gateway hung): ``_every_node`` reads it first and hands each relay the bytes."""
    import asyncio

    reads: list[int] = []

    async def receive() -> dict[str, Any]:
        reads.append(1)
        if len(reads) > 1:
            await asyncio.sleep(3600)  # what a second read of an HTTP/2 body does
        await asyncio.sleep(0.01)  # the body arrives a little later: other relays ask meanwhile
        return {"type": "http.request", "body": b'{"steps": []}', "more_body": False}

    sent: list[bytes | None] = []

    class Forwarder:
        async def send(self, request: Any, node: Any, body: bytes | None = None, **_: Any) -> Any:
            sent.append(body if body is not None else await request.body())
            return builds.Relayed(202, [], b"{}", node)

    nodes = [SimpleNamespace(id=f"n{i}") for i in (1, 2, 3)]
    gw = SimpleNamespace(nodes=SimpleNamespace(up=lambda: nodes, down=lambda: []), forwarder=Forwarder())
    scope = {"type": "http", "method": "POST", "path": "/v2/templates/t/builds/b", "headers": [], "query_string": b"",
             "app": SimpleNamespace(state=SimpleNamespace(gateway=gw))}  # fmt: skip
    answers, _ = await asyncio.wait_for(builds._every_node(Request(scope, receive)), 5)  # type: ignore[misc]
    assert sent == [b'{"steps": []}'] * 3 and len(answers) == 3


# ---- build once: every node names one shared store ------------------------------------------------
def _shared(answers: dict[str, tuple[int, Any]], store: str | None = "file:///shared") -> tuple[Gateway, PerNode]:
    gw, fwd = _gw(answers)
    for n in gw.nodes.nodes.values():
        n.store = store
    return gw, fwd


async def test_with_a_shared_store_the_build_goes_to_one_node() -> None:
    made = (202, {"templateID": "t1", "buildID": "b1"})
    gw, fwd = _shared({"n1": made, "n2": made, "n3": made})
    assert builds.shared_store(gw) == "file:///shared"
    r = await builds.request_build(_request(gw, "POST", "/v3/templates", {"name": "x"}))
    assert r.status_code == 202 and json.loads(bytes(r.body))["templateID"] == "t1"
    assert [n for n, *_ in fwd.sent] == ["n1"]  # placed: the emptiest; no replay


async def test_the_build_goes_to_a_node_that_holds_the_template_already() -> None:
    made = (202, {"templateID": "t1", "buildID": "b1"})
    gw, fwd = _shared({"n1": made, "n2": made, "n3": made})
    gw.nodes.nodes["n1"].counts = {"running": 1}  # as busy as n2
    gw.nodes.nodes["n2"].held = frozenset({"x", "t1"})  # its cached steps are there
    await builds.request_build(_request(gw, "POST", "/v3/templates", {"name": "x"}))
    assert [n for n, *_ in fwd.sent] == ["n2"]


async def test_nodes_that_do_not_share_one_store_replay() -> None:
    made = (202, {"templateID": "t1", "buildID": "b1"})
    gw, fwd = _shared({"n1": made, "n2": made, "n3": made})
    gw.nodes.nodes["n3"].store = "file:///elsewhere"
    assert builds.shared_store(gw) is None
    await builds.request_build(_request(gw, "POST", "/v3/templates", {"name": "x"}))
    assert sorted(n for n, *_ in fwd.sent) == ["n1", "n2", "n3"]


async def test_building_once_the_nodes_that_do_not_know_the_build_are_left_out() -> None:
    unknown = (404, {"message": "build 'b1' of template 't1' not found"})
    gw, fwd = _shared({"n1": unknown, "n2": (202, {}), "n3": unknown})
    r = await builds.on_every_node(_request(gw, "POST", "/v2/templates/t1/builds/b1", {"steps": []}))
    assert r.status_code == 202 and r.headers["x-aenv-node"] == "n2"
    link = "http://gw:1/aenv/build-files/" + "a" * 64
    fwd.answers["n2"] = (201, {"present": False, "url": link + "?token=tok2"})
    r = await builds.file_link(_request(gw, "GET", "/templates/t1/files/" + "a" * 64), "t1", "a" * 64)
    token = parse_qs(urlsplit(json.loads(bytes(r.body))["url"]).query)["token"][0]
    assert list(json.loads(builds.base64.urlsafe_b64decode(token[4:] + "==="))) == ["n2"]  # the upload goes there only
    fwd.answers["n2"] = _status("ready", 1)
    body = json.loads(bytes((await builds.build_status(_request(gw, "GET", "/s"), "t1", "b1")).body))
    assert body["status"] == "ready"
    fwd.answers = {n: unknown for n in ("n1", "n2", "n3")}  # nobody knows it: the 404
    r = await builds.on_every_node(_request(gw, "POST", "/v2/templates/t1/builds/b1", {"steps": []}))
    assert r.status_code == 404

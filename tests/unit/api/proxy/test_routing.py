"""Routing (routing.py): which requests are sandbox traffic and where they go, what the proxy refuses,
and the E2B-shaped errors it answers with."""

from __future__ import annotations

import json
from typing import Any

import pytest

from aenv.api.proxy import ENVD_PORT, SandboxProxy, route
from aenv.api.proxy.routing import refusal, route_signed_files_url, sandbox_error, unsigned_files_url
from tests.unit.api.proxy.helpers import Exchange, respond


def _scope(*headers: tuple[bytes, bytes], path: str = "/x", method: str = "GET", query: bytes = b"") -> dict[str, Any]:
    return {"type": "http", "method": method, "path": path, "query_string": query, "headers": list(headers)}


async def test_errors_become_502(rig: Any) -> None:
    proxy, orch, _ = await rig(respond(b"SSH-2.0-OpenSSH_9.2\r\n\r\n"))
    ex = Exchange(proxy)
    ex.body(b"")
    await ex.done()
    assert ex.status == 502 and b"unreachable" in ex.content
    ex = Exchange(proxy, sandbox="nosuch")
    ex.body(b"")
    await ex.done()
    assert ex.status == 502 and b"The sandbox was not found" in ex.content
    ex = Exchange(proxy, port=9)
    ex.body(b"")
    await ex.done()
    assert ex.status == 502 and b"port is not open" in ex.content
    ex = Exchange(proxy, path="/init", port=49983)
    ex.body(b"")
    await ex.done()
    assert ex.status == 403


# ---- added with the split ---------------------------------------------------------------------------


def test_route_from_headers() -> None:
    assert route(_scope((b"e2b-sandbox-id", b" abc "))) == ("abc", ENVD_PORT)
    assert route(_scope((b"e2b-sandbox-id", b"abc"), (b"e2b-sandbox-port", b" 8080"))) == ("abc", 8080)
    assert route(_scope((b"e2b-sandbox-id", b"abc"), (b"e2b-sandbox-port", b"http"))) == ("abc", -1)
    # The header wins over a routing Host.
    assert route(_scope((b"host", b"3000-other.e2b.local"), (b"e2b-sandbox-id", b"abc"))) == ("abc", ENVD_PORT)
    # An empty sandbox header does not route; the Host still may.
    assert route(_scope((b"e2b-sandbox-id", b" "), (b"host", b"3000-other.e2b.local"))) == ("other", 3000)
    assert route(_scope((b"e2b-sandbox-port", b"8080"))) is None
    assert route({"type": "http"}) is None  # no headers at all


def test_route_from_host() -> None:
    assert route(_scope((b"host", b"8080-abc123.sandbox.example.com"))) == ("abc123", 8080)
    assert route(_scope((b"host", b"49983-i_x-9.localhost:3000"))) == ("i_x-9", ENVD_PORT)
    assert route(_scope((b"host", b"99999-abc.e2b.local"))) == ("abc", 99999)  # refused later, with a 400


@pytest.mark.parametrize(
    "host",
    [
        b"127.0.0.1:8000",
        b"localhost",
        b"",
        b"abc-8080.e2b.local",  # id first
        b"8080-abc",  # no dot after the id
        b"123456-abc.e2b.local",  # six digits
        b"-abc.e2b.local",  # no port
        b"8080-.e2b.local",  # no id
        b"8080--abc.e2b.local",  # an id starting with a hyphen
        b"8080-ABC.e2b.local",  # upper case
        b"8080-a" + b"b" * 64 + b".e2b.local",  # an id over 64 characters
        b" 8080-abc.e2b.local",
        b"www.8080-abc.e2b.local",  # not at the start
    ],
)
def test_route_ignores_hosts_that_do_not_name_a_sandbox(host: bytes) -> None:
    assert route(_scope((b"host", host))) is None


def test_refusal() -> None:
    for port in (-1, 0, 65536, 99999):
        status, body = refusal(_scope(), port)  # type: ignore[misc]
        assert status == 400 and json.loads(body) == {"code": 400, "message": f"invalid E2b-Sandbox-Port '{port}'"}
    assert refusal(_scope(path="/init"), ENVD_PORT) == (403, b'{"code": 403, "message": "internal envd route"}')
    assert refusal(_scope(path="/init"), 8080) is None  # only envd's own
    assert refusal(_scope(path="/files"), ENVD_PORT) is None
    assert refusal(_scope(), 1) is None and refusal(_scope(), 65535) is None


def test_error_shapes() -> None:
    status, body = sandbox_error("abc", "The sandbox was not found")
    assert status == 502 and json.loads(body) == {"sandboxId": "abc", "message": "The sandbox was not found", "code": 502}
    status, body = unsigned_files_url()
    assert status == 401 and json.loads(body)["code"] == 401


class Signers:
    def __init__(self, answer: str | None = "sbx") -> None:
        self.answer = answer
        self.asked: list[tuple[str, str, str, str, str | None]] = []
        self.looked_up = 0

    def get(self) -> Signers:
        self.looked_up += 1
        return self

    def find_by_file_signature(self, path: str, op: str, user: str, signature: str, expiration: str | None) -> str | None:
        self.asked.append((path, op, user, signature, expiration))
        return self.answer


def test_route_signed_files_url() -> None:
    signers = Signers()
    q = b"path=/home/user/a.txt&username=user&signature=v1_abc&signature_expiration=99"
    assert route_signed_files_url(_scope(path="/files", query=q), signers.get) == ("sbx", ENVD_PORT)
    assert route_signed_files_url(_scope(path="/files", method="POST", query=b"path=/a&signature=v1_x"), signers.get)
    assert signers.asked == [("/home/user/a.txt", "read", "user", "v1_abc", "99"), ("/a", "write", "", "v1_x", None)]
    assert route_signed_files_url(_scope(path="/files", query=q), Signers(None).get) is None  # nobody signed it
    quiet = Signers()
    for scope in (
        _scope(path="/files", query=b"path=/a&signature=v2_x"),  # not a v1 signature
        _scope(path="/files", query=b"signature=v1_x"),  # no path
        _scope(path="/files"),
        _scope(path="/files", method="PUT", query=b"path=/a&signature=v1_x"),
        _scope(path="/filesx", query=b"path=/a&signature=v1_x"),
    ):
        assert route_signed_files_url(scope, quiet.get) is None
    assert quiet.looked_up == 0  # the orchestrator is asked only about a signed URL


class Recorder:
    """The control-plane app behind the proxy: records what reached it."""

    def __init__(self) -> None:
        self.scopes: list[dict[str, Any]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.scopes.append(scope)


async def _call(proxy: SandboxProxy, scope: dict[str, Any]) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await proxy(scope, receive, send)
    return sent


async def test_what_falls_through_to_the_control_plane() -> None:
    app, signers = Recorder(), Signers(None)
    proxy = SandboxProxy(app, signers.get)  # type: ignore[arg-type]
    lifespan = {"type": "lifespan"}
    plain = _scope((b"host", b"127.0.0.1:3000"), path="/sandboxes")
    assert await _call(proxy, lifespan) == [] and await _call(proxy, plain) == []
    assert app.scopes == [lifespan, plain]
    # /files that no header routes and no sandbox signed: envd's 401, not the control plane's 404.
    sent = await _call(proxy, _scope(path="/files", query=b"path=/a&signature=v1_x"))
    assert sent[0]["status"] == 401 and (b"content-type", b"application/json") in sent[0]["headers"]
    assert json.loads(sent[1]["body"])["code"] == 401 and len(app.scopes) == 2
    # A routed request with a bad port: a 400, and neither the orchestrator nor the app is asked.
    sent = await _call(proxy, _scope((b"host", b"0-abc.e2b.local")))
    assert sent[0]["status"] == 400 and len(app.scopes) == 2 and signers.asked == [("/a", "read", "", "v1_x", None)]

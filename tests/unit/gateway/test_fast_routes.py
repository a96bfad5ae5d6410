"""Creates past FastAPI's routing answer as the app would: the same key check, the same error shapes from
the app's own exception handlers, and anything else still reaches the app."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from aenv.api import errors
from aenv.api.proxy.codec import Message
from aenv.gateway.fast_routes import FastRoutes
from aenv.teams import Quota, TeamDirectory


class Boom(Exception):
    pass


def _app() -> tuple[FastAPI, FastRoutes]:
    api = FastAPI()
    errors.install(api)
    api.state.teams = TeamDirectory(["secret"], {}, [], Quota())

    @api.exception_handler(Boom)
    async def _boom(_: Request, exc: Boom) -> JSONResponse:
        return JSONResponse({"code": 502, "message": f"boom: {exc}"}, status_code=502)

    async def create(request: Request) -> Response:
        body = json.loads(await request.body())
        if body.get("fail") == "boom":
            raise Boom("node n2")
        if body.get("fail") == "crash":
            raise RuntimeError("unexpected")
        return JSONResponse({"sandboxID": "sbx1", "gateway": request.app.state.teams is api.state.teams},
                            status_code=201)  # fmt: skip

    return api, FastRoutes(api, {("POST", "/sandboxes"): create})


def _scope(path: str, key: str | None, method: str = "POST") -> dict[str, Any]:
    headers = [(b"content-type", b"application/json")] + ([(b"x-api-key", key.encode())] if key else [])
    return {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
            "headers": headers, "http_version": "1.1", "scheme": "http", "root_path": ""}  # fmt: skip


async def _serve(fast: FastRoutes, scope: dict[str, Any], body: dict[str, Any]) -> tuple[int, Any]:
    handler = fast.find(scope)
    assert handler is not None
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    await fast.serve(handler, scope, receive, send)
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


async def test_a_create_is_answered_by_its_handler_with_the_app_as_request_app() -> None:
    _, fast = _app()
    assert await _serve(fast, _scope("/sandboxes", "secret"), {}) == (201, {"sandboxID": "sbx1", "gateway": True})


async def test_a_create_without_a_valid_key_is_refused_as_the_app_refuses_it() -> None:
    _, fast = _app()
    for key in (None, "wrong"):
        status, body = await _serve(fast, _scope("/sandboxes", key), {})
        assert status == 401
        assert body == {"code": 401, "message": "Invalid API key, please check your credentials"}


async def test_what_the_handler_raises_is_answered_by_the_apps_exception_handlers() -> None:
    _, fast = _app()
    assert await _serve(fast, _scope("/sandboxes", "secret"), {"fail": "boom"}) == (502, {"code": 502,
                                                                                        "message": "boom: node n2"})
    status, body = await _serve(fast, _scope("/sandboxes", "secret"), {"fail": "crash"})
    assert (status, body) == (500, {"code": 500, "message": "internal error: RuntimeError"})


def test_only_the_listed_method_and_path_take_the_fast_route() -> None:
    _, fast = _app()
    assert fast.find(_scope("/sandboxes", None, method="GET")) is None
    assert fast.find(_scope("/sandboxes/sbx1", None)) is None
    assert fast.find({**_scope("/sandboxes", None), "type": "websocket"}) is None

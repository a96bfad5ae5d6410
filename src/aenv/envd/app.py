"""The envd ASGI app: routes, the token middleware, and ``/init``.

``build_app`` wires the services around one ``SandboxState`` and one
``ProcessTable``; the Connect endpoints are raw ASGI apps mounted as routes.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.envd.auth import TokenMiddleware
from aenv.envd.files import FilesRoutes, error_response
from aenv.envd.filesystem import FilesystemService
from aenv.envd.identity import SandboxState
from aenv.envd.metrics import MetricsSampler
from aenv.envd.process import ProcessService
from aenv.envd.proctable import ProcessTable

log = logging.getLogger("aenv.envd")

MAX_INIT_BODY = 1024 * 1024


def apply_init(state: SandboxState, body: dict[str, Any]) -> None:
    """Apply a ``POST /init`` body: present, non-null fields replace state; envVars merge."""
    env_vars = body.get("envVars")
    if env_vars is not None:
        if not isinstance(env_vars, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items()
        ):
            raise ValueError("envVars must be an object of strings")
        state.env_vars.update(env_vars)
    for key, attr in (
        ("accessToken", "access_token"),
        ("defaultUser", "default_user"),
        ("defaultWorkdir", "default_workdir"),
        ("sandboxId", "sandbox_id"),
        ("templateId", "template_id"),
    ):
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise ValueError(f"{key} must be a string")  # noqa: TRY004
        if key in ("accessToken", "defaultWorkdir") and value == "":
            setattr(state, attr, None)  # an empty string clears these
        elif value or key in ("sandboxId", "templateId"):
            setattr(state, attr, value)


def build_app(state: SandboxState | None = None, table: ProcessTable | None = None) -> Any:
    state = state or SandboxState()
    table = table or ProcessTable()
    processes = ProcessService(state, table)
    filesystem = FilesystemService(state)
    files = FilesRoutes(state)
    sampler = MetricsSampler()

    async def health(request: Request) -> Response:
        return Response(status_code=204)

    async def envs(request: Request) -> Response:
        return JSONResponse(state.sandbox_env())

    async def metrics(request: Request) -> Response:
        return JSONResponse(await sampler.sample())

    async def init(request: Request) -> Response:
        try:
            raw = b""
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > MAX_INIT_BODY:
                    return error_response(413, "init body too large")
            body = json.loads(raw or b"{}")
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")  # noqa: TRY004
            apply_init(state, body)
        except ClientDisconnect:
            return Response(status_code=400)
        except ValueError as exc:
            return error_response(400, f"invalid init body: {exc}")
        return Response(status_code=204)

    async def files_get(request: Request) -> Response:
        return await files.get(request)

    async def files_post(request: Request) -> Response:
        try:
            return await files.post(request)
        except ClientDisconnect:
            return Response(status_code=400)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/envs", envs, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/init", init, methods=["POST"]),
        Route("/files", files_get, methods=["GET"]),
        Route("/files", files_post, methods=["POST"]),
    ]
    for path, endpoint in {**processes.routes(), **filesystem.routes()}.items():
        routes.append(Route(path, endpoint, methods=["POST"]))  # type: ignore[arg-type]
    app = Starlette(routes=routes)
    app.state.sandbox = state
    app.state.processes = table
    return TokenMiddleware(app, state)

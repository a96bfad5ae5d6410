"""The envd ASGI app: routes, the token middleware, and ``/init``.

``build_app`` wires the services around one ``SandboxState`` and one
``ProcessTable``; the Connect endpoints are raw ASGI apps mounted as routes.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
from typing import Any

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.envd import limits, mergeable, relay, trust
from aenv.envd.auth import TokenMiddleware
from aenv.envd.connect import Receive, Scope, Send
from aenv.envd.files import FilesRoutes, error_response
from aenv.envd.filesystem import FilesystemService
from aenv.envd.identity import MAX_SEED_BYTES, SandboxState, reseed_rng, set_wall_clock
from aenv.envd.metrics import MetricsSampler
from aenv.envd.process import ProcessService
from aenv.envd.proctable import ProcessTable

log = logging.getLogger("aenv.envd")

MAX_INIT_BODY = 1024 * 1024
HOST_FACTS_HEADER = (
    "X-Aenv-Host-Facts"  # on /init: what hostTime/seed did, e.g. "hostTime=set,seed=write+reseed"
)


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


def parse_host_facts(body: dict[str, Any]) -> tuple[float | None, bytes | None]:
    """The VM runtime's post-restore fields of ``POST /init``, validated: ``hostTime`` (unix
    seconds, a number) and ``seed`` (base64, 1..512 bytes). Both optional. Raises ValueError."""
    host_time = body.get("hostTime")
    seed_b64 = body.get("seed")
    if host_time is not None and (isinstance(host_time, bool) or not isinstance(host_time, (int, float))):
        raise ValueError("hostTime must be a number (unix seconds)")
    if host_time is not None and not 0 < host_time < 2**33:
        raise ValueError("hostTime out of range")
    seed: bytes | None = None
    if seed_b64 is not None:
        if not isinstance(seed_b64, str):
            raise ValueError("seed must be a base64 string")  # noqa: TRY004
        try:
            seed = base64.b64decode(seed_b64, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("seed must be valid base64") from None
        if not 1 <= len(seed) <= MAX_SEED_BYTES:
            raise ValueError(f"seed must decode to 1..{MAX_SEED_BYTES} bytes")
    return (None if host_time is None else float(host_time)), seed


def apply_host_facts(host_time: float | None, seed: bytes | None) -> dict[str, str]:
    """Set the wall clock and reseed the kernel RNG (a restored or forked VM guest wakes up with
    its snapshot's clock and CRNG state). Failing to apply (no CAP_SYS_TIME/CAP_SYS_ADMIN, e.g.
    under ``ns``) is logged and reported, not fatal. Returns what happened, per field."""
    out: dict[str, str] = {}
    if host_time is not None:
        try:
            set_wall_clock(host_time)
            out["hostTime"] = "set"
        except OSError as exc:
            log.warning("init: cannot set the clock: %s", exc)
            out["hostTime"] = "failed"
    if seed is not None:
        try:
            out["seed"] = "+".join(reseed_rng(seed))
        except OSError as exc:
            log.warning("init: cannot reseed the RNG: %s", exc)
            out["seed"] = "failed"
    return out


def build_app(state: SandboxState | None = None, table: ProcessTable | None = None) -> Any:
    state = state or SandboxState()
    table = table or ProcessTable()
    processes = ProcessService(state, table)
    filesystem = FilesystemService(state)
    files = FilesRoutes(state)
    sampler = MetricsSampler()
    relays = relay.Relays()

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
            host_time, seed = parse_host_facts(body)
            wanted_limits = limits.parse(body)
            egress_ca = trust.check(body["aenvEgressCa"]) if body.get("aenvEgressCa") is not None else None
            loopback = relay.parse(body["aenvLoopbackRelay"]) if body.get("aenvLoopbackRelay") is not None else None
            apply_init(state, body)
        except ClientDisconnect:
            return Response(status_code=400)
        except ValueError as exc:
            return error_response(400, f"invalid init body: {exc}")
        done = apply_host_facts(host_time, seed)
        if egress_ca is not None:  # the egress proxy's CA for this sandbox's header rules (envd/trust.py)
            try:
                await asyncio.to_thread(trust.install, egress_ca)
                done["egressCa"] = "trusted"
            except OSError as exc:
                log.warning("init: cannot trust the egress CA: %s", exc)
                done["egressCa"] = "failed"
        if loopback is not None:  # a vm's loopback to this server's sandbox hosts (envd/relay.py)
            done["relay"] = await relays.set(*loopback)
        mergeable.rearm()  # /init follows every restore: processes started from now on are mergeable again
        if wanted_limits is not None:
            try:
                done["limits"] = limits.apply(*wanted_limits)
            except OSError as exc:
                log.warning("init: cannot set the sandbox limits: %s", exc)
                done["limits"] = "failed"
        headers = {HOST_FACTS_HEADER: ",".join(f"{k}={v}" for k, v in done.items())} if done else None
        return Response(status_code=204, headers=headers)

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
    guarded = TokenMiddleware(app, state)

    async def serve(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") != "/health":
            mergeable.touch()  # work: this process is not idle (merged only once it is, mergeable.py)
        await guarded(scope, receive, send)

    return serve

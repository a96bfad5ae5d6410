"""Errors become E2B-shaped responses here, and only here: ``{"code": <status>, "message": <text>}``.

Domain errors are mapped by walking the exception's MRO, so a subclass inherits its parent's status.
Anything unmapped is a 500 that is logged with its traceback; the client still gets a JSON body.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from aenv import errors as e

log = logging.getLogger("aenv.api")

STATUS: dict[type[BaseException], int] = {
    e.NotFound: 404,
    e.Gone: 410,
    e.InvalidRequest: 400,
    e.StateError: 409,
    e.Conflict: 409,
    e.CapacityError: 429,
    e.GuestUnresponsive: 503,  # the SDK's ServiceBusyException: the sandbox keeps running
    e.SandboxUnreachable: 502,
    e.RuntimeFailure: 500,
    e.ImageError: 400,
    e.StoreUnavailable: 503,
    e.StoreError: 500,
    e.AenvError: 500,
}


def error_response(status: int, message: str, headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse({"code": status, "message": message, **extra}, status_code=status, headers=headers)


GONE_PREFERENCE = "aenv-gone=410"


def prefers_gone_410(prefer: list[str]) -> bool:
    """Whether the request's ``Prefer`` headers (RFC 7240) hold ``aenv-gone=410``."""
    return any(p.strip().lower().replace(" ", "") == GONE_PREFERENCE for h in prefer for p in h.split(","))


def status_for(exc: BaseException) -> int:
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)


def install(app: FastAPI) -> None:
    @app.exception_handler(e.AenvError)
    async def _domain(request: Request, exc: e.AenvError) -> JSONResponse:
        status = status_for(exc)
        headers = None
        extra: dict[str, Any] = {}
        if isinstance(exc, e.SandboxGone):
            # The E2B SDKs know 404 (NotFoundException) only; a client that asks gets the honest 410.
            extra.update(reason=exc.reason, endedAt=exc.at)
            if prefers_gone_410(request.headers.getlist("prefer")):
                status, headers = 410, {"Preference-Applied": GONE_PREFERENCE}
        elif isinstance(exc, e.QuotaExceeded):
            extra.update(reason="quota", quota=exc.quota, limit=exc.limit)
            if exc.hard:
                status = 403  # the request alone is over the limit: no retry would help
            else:
                headers = {"Retry-After": str(max(1, round(exc.retry_after)))}
        elif isinstance(exc, e.CapacityError):
            headers = {"Retry-After": str(max(1, round(exc.retry_after)))}
            extra["reason"] = exc.reason  # machine-readable: capacity | quota | restoring
            status = 503 if exc.reason == "restoring" else status
        elif isinstance(exc, e.StoreUnavailable):
            headers = {"Retry-After": str(max(1, round(exc.retry_after)))}
            extra["reason"] = "store_unavailable"
        elif isinstance(exc, e.MachineMismatch):  # where it can go instead: a node whose machine is this one
            extra.update(reason="machine", snapshotMachine=exc.recorded, nodeMachine=exc.here)
        elif isinstance(exc, e.GuestUnresponsive):
            headers = {"Should-Retry": "false"}  # the SDK would retry a 503; the guest decides, not load
        if isinstance(why := getattr(exc, "reason", None), str):
            extra.setdefault("reason", why)  # machine-readable, e.g. lease_unknown
        if status >= 500:
            log.error("error %s: %s %s", status, exc, exc.context)
        return error_response(status, exc.message, headers, **extra)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}")

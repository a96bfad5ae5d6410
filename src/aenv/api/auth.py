"""API-key auth for the control plane.

Keys are kept only as SHA-256 digests in memory (a config entry may already be a digest,
written ``sha256:<hex>``), compared in constant time. No keys configured = auth off (the server then
binds to 127.0.0.1 unless told otherwise, and warns loudly if it is not).
"""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request
from starlette.exceptions import HTTPException


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_digests(configured: list[str]) -> list[str]:
    return [k[len("sha256:") :] if k.startswith("sha256:") else digest(k) for k in configured]


def key_is_valid(presented: str | None, digests: list[str]) -> bool:
    if not digests:
        return True
    if not presented:
        return False
    d = digest(presented)
    ok = False
    for known in digests:
        ok |= hmac.compare_digest(d, known)
    return ok


def presented_key(request: Request) -> str | None:
    """The key a request carries: ``X-API-KEY``, else an ``Authorization: Bearer`` token."""
    presented = request.headers.get("x-api-key")
    if presented is None:
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            presented = auth[7:].strip()
    return presented


async def require_api_key(request: Request) -> None:
    digests: list[str] = request.app.state.api_key_digests
    if not digests:
        return
    presented = presented_key(request)
    if not key_is_valid(presented, digests):
        raise HTTPException(401, "Invalid API key, please check your credentials")

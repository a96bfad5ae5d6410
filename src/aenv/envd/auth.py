"""Access-token checks (spec §3.2): the token middleware and ``/files`` URL signatures.

When the sandbox has an access token, every route needs ``X-Access-Token``
except ``/health``, ``/init`` and ``/files`` (which also accept a signed URL).
All comparisons are constant-time.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time

from aenv.envd.connect import Receive, Scope, Send
from aenv.envd.identity import SandboxState

UNAUTHORIZED_MESSAGE = (
    "unauthorized access, please provide a valid access token or method signing if supported"
)
_EXEMPT = frozenset({"/health", "/init", "/files"})


class SignatureError(Exception):
    """A /files request carries neither a valid token nor a valid signature."""


def compute_signature(
    path: str, operation: str, username: str, token: str, expiration: int | None = None
) -> str:
    raw = f"{path}:{operation}:{username}:{token}"
    if expiration is not None:
        raw += f":{expiration}"
    digest = hashlib.sha256(raw.encode()).digest()
    return "v1_" + base64.b64encode(digest).decode().rstrip("=")


def tokens_equal(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def validate_files_request(
    token: str | None,
    header_token: str | None,
    path: str,
    operation: str,
    username: str | None,
    signature: str | None,
    expiration: str | None,
    now: float | None = None,
) -> None:
    """Raise ``SignatureError`` unless the request may touch ``path`` (envd ``validateSigning``)."""
    if not token:
        return
    if header_token is not None:
        if not tokens_equal(header_token, token):
            raise SignatureError(UNAUTHORIZED_MESSAGE)
        return
    if not signature:
        raise SignatureError("missing signature query parameter")
    exp: int | None = None
    if expiration:
        try:
            exp = int(expiration)
        except ValueError:
            raise SignatureError("invalid signature expiration") from None
        if exp < int(now if now is not None else time.time()):
            raise SignatureError("signature is already expired")
    expected = compute_signature(path, operation, username or "", token, exp)
    if not hmac.compare_digest(signature.encode(), expected.encode()):
        raise SignatureError("invalid signature")


class TokenMiddleware:
    """ASGI middleware: 401 on non-exempt routes without the right ``X-Access-Token``."""

    def __init__(self, app: object, state: SandboxState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = self.state.access_token
        if scope["type"] == "http" and token and scope.get("path") not in _EXEMPT:
            given = next(
                (v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"x-access-token"), None
            )
            if not tokens_equal(given, token):
                body = json.dumps({"code": 401, "message": UNAUTHORIZED_MESSAGE}).encode()
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [(b"content-type", b"application/json")],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)  # type: ignore[operator]

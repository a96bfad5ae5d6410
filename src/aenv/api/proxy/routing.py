"""Which requests are sandbox traffic and where they go (spec §1.5): the ``E2b-Sandbox-Id`` and
``E2b-Sandbox-Port`` headers, a ``<port>-<id>.`` Host, or, for a signed ``/files`` URL that names no
sandbox, the sandbox whose token signed it. Everything else falls through to the control plane.

Also the proxy's own answers, shaped like E2B's so that the SDKs raise the error they would against E2B:
a bad port, envd's internal routes (the orchestrator's alone, never a client's), an unsigned file URL, and
a sandbox that cannot be reached.
"""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import parse_qs

from aenv.errors import NotFound, PortNotOpen, SandboxGone
from aenv.mux import MuxError, StreamRefused
from aenv.runtime.envd_client import ENVD_PORT as ENVD_PORT  # the port a request names no port for

from .codec import Scope, Send, UpstreamError

_HOST_RE = re.compile(r"^(\d{1,5})-([a-z0-9][a-z0-9_-]{0,63})\.")
# envd's internal routes: only the orchestrator may call them, never a client through the proxy.
_ENVD_INTERNAL = {"/init"}

Target = tuple[str, int]  # (sandbox id, port)


class FileSigners(Protocol):
    """What routing needs of the orchestrator."""

    def find_by_file_signature(
        self, path: str, op: str, user: str, signature: str, expiration: str | None
    ) -> str | None: ...


def route(scope: Scope) -> Target | None:
    """(sandbox id, port) if this request is sandbox traffic, else None. A port header that is not a
    number gives port -1, which ``refusal`` turns into a 400."""
    sandbox_id = port = host = None
    for name, value in scope.get("headers", ()):
        if name == b"e2b-sandbox-id":
            sandbox_id = value.decode("latin-1").strip()
        elif name == b"e2b-sandbox-port":
            port = value.decode("latin-1").strip()
        elif name == b"host":
            host = value.decode("latin-1")
    if sandbox_id:
        try:
            p = int(port) if port else ENVD_PORT
        except ValueError:
            p = -1
        return sandbox_id, p
    if host:
        m = _HOST_RE.match(host)
        if m:
            return m.group(2), int(m.group(1))
    return None


def route_signed_files_url(scope: Scope, get_orchestrator: Callable[[], FileSigners]) -> Target | None:
    """``download_url()``/``upload_url()`` carry no sandbox ID when E2B_SANDBOX_URL is set: find the
    sandbox whose access token produced the URL's signature (spec §1.5 workaround). The orchestrator is
    asked only for a URL that carries a signature."""
    if scope["path"] != "/files" or scope["method"] not in ("GET", "POST"):
        return None
    params = parse_qs((scope.get("query_string") or b"").decode("latin-1"))
    signature = (params.get("signature") or [""])[0]
    path = (params.get("path") or [""])[0]
    if not signature.startswith("v1_") or not path:
        return None
    user = (params.get("username") or [""])[0]
    expiration = (params.get("signature_expiration") or [None])[0]
    op = "read" if scope["method"] == "GET" else "write"
    sandbox_id = get_orchestrator().find_by_file_signature(path, op, user, signature, expiration)
    return (sandbox_id, ENVD_PORT) if sandbox_id else None


def json_error(status: int, body: dict[str, Any]) -> tuple[int, bytes]:
    return status, json.dumps(body).encode()


def refusal(scope: Scope, port: int) -> tuple[int, bytes] | None:
    """The error for a target the proxy will not forward to: a port out of range, or envd's internal
    routes. None for one it will."""
    if not 0 < port < 65536:
        return json_error(400, {"code": 400, "message": f"invalid E2b-Sandbox-Port '{port}'"})
    if port == ENVD_PORT and scope["path"] in _ENVD_INTERNAL:
        return json_error(403, {"code": 403, "message": "internal envd route"})
    return None


def ingress(scope: Scope, sandbox_id: str, port: int, rules: tuple[str | None, str | None]) -> tuple[Scope, tuple[int, bytes] | None]:
    """E2B's inbound settings on a user port (envd has its own token): with a traffic token
    (``allowPublicTraffic: false``) a request without ``e2b-traffic-access-token`` is a 403; the token
    is not passed on, and ``maskRequestHost`` (``${PORT}`` = the port) is the Host the sandbox sees.
    Returns the scope to forward and the refusal, if any."""
    token, mask = rules
    if port == ENVD_PORT or (token is None and mask is None):
        return scope, None
    headers: list[tuple[bytes, bytes]] = []
    given = b""
    for name, value in scope.get("headers", ()):
        if name == b"e2b-traffic-access-token":
            given = value.strip()
        elif name == b"host" and mask is not None:
            continue
        else:
            headers.append((name, value))
    if token is not None and not hmac.compare_digest(given, token.encode()):
        message = f"sandbox {sandbox_id} requires a valid e2b-traffic-access-token header (allowPublicTraffic is false)"
        return scope, json_error(403, {"code": 403, "message": message})
    if mask is not None:
        headers.append((b"host", mask.replace("${PORT}", str(port)).encode("latin-1", "replace")))
    return {**scope, "headers": headers}, None


def unsigned_files_url() -> tuple[int, bytes]:
    """envd's answer for a ``/files`` request that no routing header names and no sandbox signed."""
    return json_error(401, {"code": 401, "message": "invalid or missing file URL signature"})


class HopDown(ConnectionError):
    """A hop before the sandbox took no connection: a gateway's to the node that owns it. Its text names
    the hop and why, so that the 502 (and the SDK's exception, which carries the message) says which node,
    not only that some connection was refused."""

    def __init__(self, message: str, node: str) -> None:
        super().__init__(message)
        self.node = node


def sandbox_error(sandbox_id: str, message: str, **extra: str) -> tuple[int, bytes]:
    """E2B's 502 for a sandbox the request could not get through to."""
    return json_error(502, {"sandboxId": sandbox_id, "message": message, "code": 502, **extra})


def upstream_error(sandbox_id: str, exc: Exception) -> tuple[int, bytes]:
    """The 502 for a failure to reach the sandbox's port, worded as E2B's proxy words it (the SDKs raise
    SandboxNotRunning / SandboxUnreachable on those words)."""
    if isinstance(exc, SandboxGone):  # E2B's words exactly (clients compare them); why, in fields of their own
        return sandbox_error(sandbox_id, "The sandbox was not found", reason=exc.reason, endedAt=exc.at,
                             detail=f"it ended at {exc.at} ({exc.reason}: {exc.detail})")
    if isinstance(exc, NotFound):
        return sandbox_error(sandbox_id, "The sandbox was not found")
    if isinstance(exc, (StreamRefused, PortNotOpen)):
        return sandbox_error(sandbox_id, "The sandbox is running but port is not open")
    if isinstance(exc, HopDown):
        return sandbox_error(sandbox_id, f"The sandbox is unreachable: {exc}", reason="node_down", node=exc.node)
    name = "RemoteProtocolError" if isinstance(exc, (UpstreamError, MuxError)) else type(exc).__name__
    return sandbox_error(sandbox_id, f"The sandbox is unreachable: {name}")


def upgrade_tokens(scope: Scope) -> list[bytes]:
    """The protocols an HTTP/1.1 request asks to switch to (``Connection: upgrade`` + ``Upgrade``), lowercased;
    empty for an ordinary request."""
    connection = upgrade = b""
    for name, value in scope.get("headers", ()):
        if name == b"connection":
            connection += b"," + value.lower()
        elif name == b"upgrade":
            upgrade += b"," + value.lower()
    if b"upgrade" not in (t.strip() for t in connection.split(b",")):
        return []
    return [t.strip() for t in upgrade.split(b",") if t.strip()]


async def respond(send: Send, status: int, body: bytes, close: bool = False) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    if close:  # the client may already have sent bytes of another protocol: this connection is done
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})

"""Console sessions: a browser logs in once with an API key and then carries an httpOnly cookie.

The key itself never reaches the page's scripts: the server keeps it in memory under a random session
token (sessions end with the server, which only means logging in again). :class:`SessionCookies` turns a
valid session cookie into the ``X-API-Key`` header before anything else reads the request, so the console
calls the very routes the SDK and the CLI call, through the same key check and team scoping, on a node
and on a gateway alike (the gateway relays the header to its nodes).

Cross-site requests: the cookie is ``SameSite=Strict``, and a request that changes anything must also
carry ``X-Aenv-Console: 1`` — a header no other site's page can add to a request to this origin without
a CORS preflight, which this server never grants.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

COOKIE = "aenv_console"
_COOKIE_NAME = COOKIE.encode()  # as raw headers carry it (the proxy checks every request it forwards)
CSRF_HEADER = b"x-aenv-console"
TTL_S = 12 * 3600
MAX_SESSIONS = 10_000  # a login flood cannot grow memory without bound: the oldest go first

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass
class _Session:
    key: str
    expires: float


class SessionStore:
    """Session token → API key, in memory, with an expiry."""

    def __init__(self, ttl_s: float = TTL_S) -> None:
        self.ttl_s = ttl_s
        self._sessions: dict[str, _Session] = {}

    def open(self, key: str) -> str:
        now = time.monotonic()
        if len(self._sessions) >= MAX_SESSIONS:
            self._sessions = {t: s for t, s in self._sessions.items() if s.expires > now}
            while len(self._sessions) >= MAX_SESSIONS:
                self._sessions.pop(next(iter(self._sessions)))
        token = secrets.token_urlsafe(32)
        self._sessions[token] = _Session(key, now + self.ttl_s)
        return token

    def key(self, token: str | None) -> str | None:
        """The key of a live session, None for an unknown or expired token."""
        if not token:
            return None
        found = self._sessions.get(token)
        if found is None:
            return None
        if found.expires <= time.monotonic():
            self._sessions.pop(token, None)
            return None
        return found.key

    def close(self, token: str | None) -> None:
        if token:
            self._sessions.pop(token, None)


def cookie_token(headers: list[tuple[bytes, bytes]] | Any) -> str | None:
    """The console cookie's value among raw ASGI headers."""
    for name, value in headers:
        if name != b"cookie":
            continue
        for part in value.decode("latin-1").split(";"):
            k, _, v = part.strip().partition("=")
            if k == COOKIE:
                return v
    return None


def with_session_key(scope: Scope, store: SessionStore) -> Scope:
    """``scope`` acting with its session's key: when it carries a live session cookie and no key of its own,
    and, unless it is a GET or HEAD, the console's header."""
    if scope["type"] != "http":
        return scope
    headers = scope.get("headers") or []
    names = {name for name, _ in headers}
    if b"x-api-key" in names or b"authorization" in names:
        return scope
    key = store.key(cookie_token(headers))
    if key is None or (scope.get("method") not in ("GET", "HEAD") and CSRF_HEADER not in names):
        return scope
    return {**scope, "headers": [*headers, (b"x-api-key", key.encode("latin-1"))]}


class SessionCookies:
    """ASGI middleware applying :func:`with_session_key` to every request."""

    def __init__(self, app: App, store: SessionStore) -> None:
        self.app = app
        self.store = store

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(with_session_key(scope, self.store), receive, send)


def without_session_cookie(scope: Scope) -> Scope:
    """``scope`` with the console's cookie taken out: what the sandbox proxy forwards, so that no process
    in a sandbox ever sees a session that could act on the control plane."""
    headers = scope.get("headers") or []
    if not any(name == b"cookie" and _COOKIE_NAME in value for name, value in headers):
        return scope
    kept: list[tuple[bytes, bytes]] = []
    for name, value in headers:
        if name == b"cookie":
            parts = [p for p in value.split(b";") if p.strip().partition(b"=")[0] != _COOKIE_NAME]
            if not parts:
                continue
            value = b";".join(parts).strip()
        kept.append((name, value))
    return {**scope, "headers": kept}

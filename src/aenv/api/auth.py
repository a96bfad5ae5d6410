"""API-key auth for the control plane, and who a request acts for.

Keys are kept only as SHA-256 digests in memory (a config entry may already be a digest, written
``sha256:<hex>``). Each valid key acts for one team (``aenv/teams.py``); the resolved
:class:`~aenv.teams.Principal` is left on ``request.state.principal`` for the routes, and the objects a
route's path names are checked against it before the route runs (``api/tenancy.py``). No keys
configured = auth off (the server then binds to 127.0.0.1 unless told otherwise, and warns loudly if it
is not).
"""

from __future__ import annotations

from fastapi import Request
from starlette.exceptions import HTTPException

from aenv.teams import OPEN, Principal, TeamDirectory, digest

__all__ = ["digest", "presented_key", "principal", "require_api_key"]

INVALID_KEY = "Invalid API key, please check your credentials"


def presented_key(request: Request) -> str | None:
    """The key a request carries: ``X-API-KEY``, else an ``Authorization: Bearer`` token."""
    presented = request.headers.get("x-api-key")
    if presented is None:
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            presented = auth[7:].strip()
    return presented


def principal(request: Request) -> Principal:
    """Who this request acts for (set by :func:`require_api_key`; the open principal without keys)."""
    who: Principal = getattr(request.state, "principal", OPEN)
    return who


async def require_api_key(request: Request) -> None:
    teams: TeamDirectory = request.app.state.teams
    who = teams.resolve(presented_key(request))
    if who is None:
        raise HTTPException(401, INVALID_KEY)
    request.state.principal = who
    if not who.admin:
        from aenv.api.tenancy import check_path_objects  # the route's path names objects: theirs?

        await check_path_objects(request, who)

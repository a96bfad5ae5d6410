"""The console's own routes: its page, its scripts, the browser libraries, and log in / log out.

Everything the console shows comes from the public API (the routes the SDK and the CLI use, plus the
read routes in ``api/routes_console.py``); these routes only serve files and manage the session cookie.
The browser libraries are installed from the npm registry by the set-up (``npm ci`` beside this file)
and served from ``node_modules`` by name: only the files listed in :data:`VENDOR` are reachable.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, Field

from aenv.api.auth import INVALID_KEY
from aenv.api.console.sessions import COOKIE, TTL_S, SessionStore, cookie_token
from aenv.api.errors import error_response
from aenv.teams import TeamDirectory, label

HERE = Path(__file__).parent
STATIC = HERE / "static"
MODULES = HERE / "node_modules"
VENDOR = {
    "xterm.js": "@xterm/xterm/lib/xterm.js",
    "xterm.css": "@xterm/xterm/css/xterm.css",
    "addon-fit.js": "@xterm/addon-fit/lib/addon-fit.js",
    "uplot.js": "uplot/dist/uPlot.iife.min.js",
    "uplot.css": "uplot/dist/uPlot.min.css",
    "cytoscape.js": "cytoscape/dist/cytoscape.min.js",
    "dagre.js": "dagre/dist/dagre.min.js",
    "cytoscape-dagre.js": "cytoscape-dagre/cytoscape-dagre.js",
}
_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html", ".svg": "image/svg+xml"}
NOT_INSTALLED = "the console's browser libraries are not installed: run scripts/setup.sh deps (npm ci in src/aenv/api/console)"

router = APIRouter(include_in_schema=False)


class Login(BaseModel):
    apiKey: str = Field(min_length=1, max_length=4096)


def _store(request: Request) -> SessionStore:
    store: SessionStore = request.app.state.console_sessions
    return store


def _file(path: Path) -> Response:
    headers = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
    return FileResponse(path, media_type=_TYPES.get(path.suffix, "application/octet-stream"), headers=headers)


@router.get("/console")
@router.get("/console/")
async def page() -> Response:
    return _file(STATIC / "index.html")


@router.get("/console/static/{name:path}")
async def static(name: str) -> Response:
    path = (STATIC / name).resolve()
    if not path.is_relative_to(STATIC.resolve()) or not path.is_file():
        return error_response(404, f"no console file '{name}'")
    return _file(path)


@router.get("/console/vendor/{name}")
async def vendor(name: str) -> Response:
    rel = VENDOR.get(name)
    if rel is None:
        return error_response(404, f"no console library '{name}'")
    path = MODULES / rel
    if not path.is_file():
        return error_response(503, NOT_INSTALLED)
    return _file(path)


@router.get("/console/session")
async def session(request: Request) -> JSONResponse:
    """What the page needs to know before it shows anything: is the server open, who is logged in."""
    teams: TeamDirectory = request.app.state.teams
    role = getattr(request.app.state, "console_role", "node")
    if teams.open:
        return JSONResponse({"open": True, "loggedIn": True, "team": None, "admin": True, "role": role})
    key = _store(request).key(cookie_token(request.scope.get("headers") or []))
    who = teams.resolve(key) if key else None
    return JSONResponse({"open": False, "loggedIn": who is not None, "team": label(who.team) if who else None,
                         "admin": bool(who and who.admin), "role": role})  # fmt: skip


@router.post("/console/login")
async def login(request: Request, body: Login) -> Response:
    teams: TeamDirectory = request.app.state.teams
    if teams.open:
        return JSONResponse({"open": True, "loggedIn": True})
    who = teams.resolve(body.apiKey)
    if who is None:
        return error_response(401, INVALID_KEY)
    resp = JSONResponse({"open": False, "loggedIn": True, "team": label(who.team), "admin": who.admin})
    resp.set_cookie(COOKIE, _store(request).open(body.apiKey), max_age=int(TTL_S), path="/", httponly=True,
                    samesite="strict", secure=request.url.scheme == "https")  # fmt: skip
    return resp


@router.post("/console/logout", status_code=204)
async def logout(request: Request) -> Response:
    _store(request).close(cookie_token(request.scope.get("headers") or []))
    resp = Response(status_code=204)
    resp.delete_cookie(COOKIE, path="/")
    return resp

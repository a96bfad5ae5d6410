"""The web console, served by ``aenv serve`` and ``aenv gateway`` under ``/console`` on their own port.

:func:`install` adds its routes and the session middleware to a FastAPI app (the node's or the gateway's).
"""

from __future__ import annotations

from fastapi import FastAPI

from aenv.api.console.routes import router
from aenv.api.console.sessions import SessionCookies, SessionStore

__all__ = ["install"]


def install(api: FastAPI, role: str) -> None:
    """Serve the console on ``api``; ``role`` (node or gateway) tells the page which pages apply."""
    store = SessionStore()
    api.state.console_sessions = store
    api.state.console_role = role
    api.include_router(router)
    api.add_middleware(SessionCookies, store=store)

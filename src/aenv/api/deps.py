"""FastAPI dependencies: the app's long-lived objects, stored on ``app.state`` by the lifespan."""

from __future__ import annotations

from fastapi import Request

from aenv.core.orchestrator import Orchestrator


async def orchestrator(request: Request) -> Orchestrator:
    # async: FastAPI runs a plain ``def`` dependency in its thread pool, a thread hop per request.
    orch: Orchestrator = request.app.state.orchestrator
    return orch

"""FastAPI dependencies: the app's long-lived objects, stored on ``app.state`` by the lifespan."""

from __future__ import annotations

from fastapi import Request

from aenv.core.orchestrator import Orchestrator


def orchestrator(request: Request) -> Orchestrator:
    orch: Orchestrator = request.app.state.orchestrator
    return orch

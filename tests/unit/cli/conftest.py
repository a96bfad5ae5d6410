"""CLI tests drive the real control plane (fake runtime behind it) through Typer's CliRunner: the
CLI's httpx clients are handed the in-process app's transport, so no port is opened."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient
from typer.testing import CliRunner, Result

from aenv.cli.main import app
from tests.unit.api.conftest import client, runtime, settings

__all__ = ["client", "runtime", "settings"]


@pytest.fixture
def aenv(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Result]:
    """``aenv(*args)`` runs the CLI at 80 columns against ``client``'s app."""
    real = httpx.Client

    def bound(*args: Any, **kw: Any) -> httpx.Client:
        kw["transport"] = client._transport
        return real(*args, **kw)

    monkeypatch.setattr("aenv.cli.client.httpx.Client", bound)
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("AENV_SERVER", "http://testserver")

    def run(*args: str) -> Result:
        return CliRunner().invoke(app, list(args))

    return run

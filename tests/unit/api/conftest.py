"""Control-plane tests against a fake runtime: lifecycle and HTTP shapes without real sandboxes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from aenv.api.app import create_app
from aenv.config import Settings
from tests.fixtures.runtime import FakeRuntime


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    s = Settings(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache", reaper_interval=0.05, max_timeout=3600)
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    return s


@pytest.fixture
def runtime() -> FakeRuntime:
    return FakeRuntime()


@contextlib.contextmanager
def keyed_client(settings: Settings, runtime: FakeRuntime, tmp_path: Path) -> Iterator[TestClient]:
    """A client of an app made with ``settings`` (keys and teams are read once, when the app starts)."""
    app = create_app(settings, runtime=runtime, ensure_base=False)  # type: ignore[arg-type]
    with TestClient(app) as c:
        c.app_state = app.app.state  # type: ignore[attr-defined]
        app.app.state.catalog.register(alias="base", kind="bootstrap", rootfs=tmp_path / "rootfs", template_id="base")
        yield c


@pytest.fixture
def client(settings: Settings, runtime: FakeRuntime, tmp_path: Path) -> Iterator[TestClient]:
    with keyed_client(settings, runtime, tmp_path) as c:
        yield c

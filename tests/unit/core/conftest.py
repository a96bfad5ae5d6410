"""Core flows over the fake runtime: one orchestrator per test, with a ``base`` template."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.core.orchestrator import Orchestrator
from aenv.core.templates import TemplateCatalog
from aenv.runtime.base import Runtime
from aenv.store.sqlite import Store
from tests.fixtures.runtime import FakeRuntime


def build_orchestrator(tmp_path: Path, runtime: Runtime) -> tuple[Orchestrator, Store]:
    """An orchestrator (not started) over ``runtime`` with a ``base`` template, and its store."""
    settings = Settings(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache", reaper_interval=3600,
                        max_timeout=3600, snapshot_store="")
    settings.state_dir.mkdir(parents=True)
    (tmp_path / "rootfs").mkdir()
    store = Store(settings.db_path)
    catalog = TemplateCatalog(settings, store)
    catalog.register(alias="base", kind="bootstrap", rootfs=tmp_path / "rootfs", template_id="base")
    return Orchestrator(settings, store, runtime, catalog), store


@pytest.fixture
async def orch(tmp_path: Path) -> AsyncIterator[Orchestrator]:
    o, store = build_orchestrator(tmp_path, FakeRuntime())
    await o.start()
    try:
        yield o
    finally:
        await o.close()
        store.close()

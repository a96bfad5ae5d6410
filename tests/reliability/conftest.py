"""Reliability fixtures: servers the tests may crash, restart, flood and feed garbage.

Unlike ``tests/integration`` (one session-wide server), most tests here own their server(s) through a
``ServerFactory`` so a crash or a leak in one test cannot spill into the next. Everything needs root
(the ns and vm runtimes do) and skips without it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.testing.server import Server
from tests.reliability.helpers import ServerFactory, api, sdk_kwargs


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Slow soak variants only run when asked (``-m slow`` or ``AENV_TESTS=all``)."""
    if os.environ.get("AENV_TESTS") == "all" or "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow or AENV_TESTS=all")
    for item in items:
        if "slow" in item.keywords and item.path.is_relative_to(Path(__file__).parent):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def runtime_name() -> str:
    return os.environ.get("AENV_TEST_RUNTIME", "ns")


@pytest.fixture(autouse=True)
def _needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("the ns and vm runtimes need root")


@pytest.fixture
def servers(tmp_path: Path, runtime_name: str) -> Iterator[ServerFactory]:
    """A factory of servers sharing one state dir; teardown leaves nothing running."""
    factory = ServerFactory(tmp_path, runtime_name, {"AENV_POOL_SIZE": "1"})
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory, runtime_name: str) -> Iterator[Server]:
    """One well-behaved server per module for tests that do not crash it."""
    if os.geteuid() != 0:
        pytest.skip("the ns and vm runtimes need root")
    factory = ServerFactory(tmp_path_factory.mktemp("aenv-rel"), runtime_name, {"AENV_POOL_SIZE": "2"})
    try:
        yield factory.start()
    finally:
        factory.close()


@pytest.fixture(scope="module")
def conn(shared_server: Server) -> dict[str, str]:
    return sdk_kwargs(shared_server)


__all__ = ["api", "sdk_kwargs"]

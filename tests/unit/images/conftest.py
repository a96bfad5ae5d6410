"""Fixtures for aenv.images unit tests. Puts the repo root on sys.path so ``tests.fixtures`` imports."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[3])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.fixtures.fakes import FakeRegistry  # noqa: E402


@pytest.fixture
def fake_registry() -> FakeRegistry:
    return FakeRegistry()

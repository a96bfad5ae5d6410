"""The client tests drive the real control plane over the API tests' fake runtime."""

from tests.unit.api.conftest import client, runtime, settings

__all__ = ["client", "runtime", "settings"]

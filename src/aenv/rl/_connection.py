"""Where the server is, for the parts of ``aenv.rl`` that use aenv's own routes (fork, leases): the
E2B SDK's ``api_url`` / ``api_key`` when given, else ``E2B_API_URL`` / ``E2B_API_KEY``."""

from __future__ import annotations

import os
from typing import Any

from aenv.client import AenvClient


def client(connection: dict[str, Any]) -> AenvClient:
    url = connection.get("api_url") or os.environ.get("E2B_API_URL") or "http://127.0.0.1:8000"
    return AenvClient(url, connection.get("api_key") or os.environ.get("E2B_API_KEY"))

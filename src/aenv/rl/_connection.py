"""Where the server is, for the parts of ``aenv.rl`` that use aenv's own routes (fork, leases): the
E2B SDK's ``api_url`` / ``api_key`` when given, else ``E2B_API_URL`` / ``E2B_API_KEY``.

A rollout would rather wait a few seconds than lose its group, so these calls ride out a gateway
restarting (connections refused) or the cluster directory away (503 with ``Retry-After``) for up to
``RETRY_FOR`` seconds; what may have been done already (a timed-out fork) is never sent twice."""

from __future__ import annotations

import os
from typing import Any

from aenv.client import AenvClient

RETRY_FOR = 30.0


def client(connection: dict[str, Any]) -> AenvClient:
    url = connection.get("api_url") or os.environ.get("E2B_API_URL") or "http://127.0.0.1:8000"
    return AenvClient(url, connection.get("api_key") or os.environ.get("E2B_API_KEY"), retry_for=RETRY_FOR)

"""envd's signed file URLs (``download_url()``/``upload_url()``): the signature a sandbox's access token
gives a path, an operation and a user. A shared word: the node's orchestrator and the gateway both find a
URL's sandbox by it."""

from __future__ import annotations

import base64
import hashlib


def file_signature(path: str, op: str, user: str, token: str, expiration: str | None) -> str:
    """envd's v1 URL signature: ``v1_`` + unpadded base64 of sha256("path:op:user:token[:expiration]")."""
    raw = f"{path}:{op}:{user}:{token}" + (f":{expiration}" if expiration else "")
    return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).decode().rstrip("=")

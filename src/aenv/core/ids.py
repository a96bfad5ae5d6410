"""Identifiers: short lowercase alphanumerics (DNS-label safe, E2B style) and opaque tokens."""

from __future__ import annotations

import secrets
import string

_ALPHABET = string.ascii_lowercase + string.digits


def new_id(length: int = 20) -> str:
    """A sandbox/template/snapshot ID; starts with a letter so it is a valid hostname label."""
    return secrets.choice(string.ascii_lowercase) + "".join(secrets.choice(_ALPHABET) for _ in range(length - 1))


def new_token() -> str:
    """An envd access token: 64 hex characters, like E2B's."""
    return secrets.token_hex(32)


def is_valid_id(value: str) -> bool:
    return 0 < len(value) <= 64 and all(c in _ALPHABET or c in "-_" for c in value)

"""QMP framing: one JSON object per line, encoded compactly, decoded under a size limit."""

from __future__ import annotations

import json
from typing import Any

from .errors import DeserializationError

Message = dict[str, Any]

DEFAULT_FRAME_LIMIT = 10 * 1024 * 1024  # QEMU's own replies are far smaller; this only bounds a bad peer


def encode(msg: Message) -> bytes:
    """Compact JSON plus the newline QMP uses as frame end."""
    return json.dumps(msg, separators=(",", ":")).encode() + b"\n"


def decode(raw: bytes) -> Message:
    """Parse one frame; anything but a JSON object is a protocol error that keeps the raw bytes."""
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DeserializationError("invalid JSON frame", raw) from exc
    if not isinstance(obj, dict):
        raise DeserializationError("frame is not a JSON object", raw)
    return obj


def command(name: str, arguments: dict[str, Any] | None, ident: str | None) -> Message:
    """Build an ``execute`` message; ``ident`` lets replies be matched to callers."""
    msg: Message = {"execute": name}
    if arguments:
        msg["arguments"] = arguments
    if ident is not None:
        msg["id"] = ident
    return msg

"""Typed access to proto3-JSON request messages.

Requests arrive as plain JSON objects. proto3 JSON lets a field be named in
lowerCamelCase (what the SDKs send) or in its original snake_case, lets
integers be strings, and lets enums be names or numbers. These helpers accept
all of that and raise ``InvalidArgument`` for anything else, so handlers read
``get_int(msg, "pid")`` instead of poking at dicts.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

from aenv.envd.errors import InvalidArgument

Message = dict[str, Any]

_CAMEL_BOUNDARY = re.compile(r"(?<!^)(?=[A-Z])")


def _raw(msg: Message, name: str) -> Any:
    """Return the value under the camelCase ``name`` or its snake_case twin (None if absent)."""
    value = msg.get(name)
    if value is None:
        snake = _CAMEL_BOUNDARY.sub("_", name).lower()
        if snake != name:
            value = msg.get(snake)
    return value


def has(msg: Message, name: str) -> bool:
    return _raw(msg, name) is not None


def get_obj(msg: Message, name: str) -> Message | None:
    value = _raw(msg, name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidArgument(f"field {name!r} must be an object")
    return value


def get_str(msg: Message, name: str, default: str = "") -> str:
    value = _raw(msg, name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise InvalidArgument(f"field {name!r} must be a string")
    return value


def get_opt_str(msg: Message, name: str) -> str | None:
    return get_str(msg, name) if has(msg, name) else None


def get_int(msg: Message, name: str, default: int = 0) -> int:
    value = _raw(msg, name)
    if value is None:
        return default
    if isinstance(value, bool):
        raise InvalidArgument(f"field {name!r} must be an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise InvalidArgument(f"field {name!r} must be an integer")


def get_bool(msg: Message, name: str, default: bool = False) -> bool:
    value = _raw(msg, name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidArgument(f"field {name!r} must be a boolean")
    return value


def get_opt_bool(msg: Message, name: str) -> bool | None:
    return get_bool(msg, name) if has(msg, name) else None


def get_bytes(msg: Message, name: str) -> bytes:
    value = _raw(msg, name)
    if value is None:
        return b""
    if not isinstance(value, str):
        raise InvalidArgument(f"field {name!r} must be a base64 string")
    padded = value + "=" * (-len(value) % 4)
    try:
        if "-" in value or "_" in value:
            return base64.urlsafe_b64decode(padded)
        return base64.b64decode(padded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidArgument(f"field {name!r} is not valid base64") from exc


def get_str_list(msg: Message, name: str) -> list[str]:
    value = _raw(msg, name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidArgument(f"field {name!r} must be a list of strings")
    return list(value)


def get_str_map(msg: Message, name: str) -> dict[str, str]:
    value = _raw(msg, name)
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise InvalidArgument(f"field {name!r} must be a map of strings")
    return dict(value)


def get_enum(msg: Message, name: str, values: dict[str, int]) -> int:
    """Return an enum field as its number; ``values`` maps names to numbers."""
    value = _raw(msg, name)
    if value is None:
        return 0
    if isinstance(value, str):
        if value in values:
            return values[value]
        raise InvalidArgument(f"field {name!r}: unknown enum value {value!r}")
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise InvalidArgument(f"field {name!r} must be an enum name or number")


def encode_bytes(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")

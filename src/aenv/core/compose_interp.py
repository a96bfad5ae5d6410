"""Compose's variable interpolation, done once on the host (pure).

Why here and not by ``docker compose`` in the sandbox: what is checked must be what runs. A project whose
``privileged: ${P}`` reads ``true`` from the environment would pass a check of the raw text; so the node
interpolates with the request's ``composeEnv`` (and nothing else: not its own environment, not a
``.env``), checks the result, and writes it back with every ``$`` doubled, which Compose reads as a
literal ``$`` and does not interpolate again.

Syntax (the Compose specification's): ``$$`` is a literal ``$``; ``$VAR`` and ``${VAR}``; ``${VAR:-d}``
(unset or empty) and ``${VAR-d}`` (unset) defaults; ``${VAR:?msg}`` and ``${VAR?msg}`` required;
``${VAR:+alt}`` and ``${VAR+alt}`` alternatives; defaults and alternatives may hold interpolations.
An unset variable without a default is the empty string, as in Compose. Keys are not interpolated.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from aenv.errors import InvalidRequest

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class _Budget:
    """Bounds the walk: YAML aliases can make a small file a huge tree (a "billion laughs")."""

    def __init__(self, limit: int) -> None:
        self.left = limit

    def take(self, where: str) -> None:
        self.left -= 1
        if self.left < 0:
            raise InvalidRequest(f"compose {where or 'file'}: the file expands to too many values (YAML aliases?)")


def interpolate(doc: Any, env: Mapping[str, str], max_values: int = 200_000) -> Any:
    """A copy of the parsed YAML ``doc`` with every string value interpolated from ``env``."""
    return _walk(doc, env, "", _Budget(max_values))


def _walk(value: Any, env: Mapping[str, str], where: str, budget: _Budget) -> Any:
    budget.take(where)
    if isinstance(value, str):
        return substitute(value, env, where)
    if isinstance(value, dict):
        return {k: _walk(v, env, f"{where}.{k}" if where else str(k), budget) for k, v in value.items()}
    if isinstance(value, list):
        return [_walk(v, env, f"{where}[{i}]", budget) for i, v in enumerate(value)]
    return value


def substitute(text: str, env: Mapping[str, str], where: str = "") -> str:
    out, i = [], 0
    while True:
        j = text.find("$", i)
        if j < 0:
            out.append(text[i:])
            return "".join(out)
        out.append(text[i:j])
        value, i = _one(text, j, env, where)
        out.append(value)


def _one(text: str, start: int, env: Mapping[str, str], where: str) -> tuple[str, int]:
    """The value of the interpolation at ``text[start] == '$'`` and the index after it."""
    nxt = text[start + 1 : start + 2]
    if nxt == "$":
        return "$", start + 2
    if nxt != "{":
        match = _NAME.match(text, start + 1)
        if match is None:
            raise _invalid(text, where)
        return env.get(match.group(), ""), match.end()
    end = _closing_brace(text, start + 2)
    if end < 0:
        raise _invalid(text, where)
    body = text[start + 2 : end]
    match = _NAME.match(body)
    if match is None:
        raise _invalid(text, where)
    name, rest = match.group(), body[match.end() :]
    value = env.get(name)
    if not rest:
        return value or "", end + 1
    op = rest[:2] if rest[:2] in (":-", ":?", ":+") else rest[:1]
    arg = rest[len(op) :]
    if op not in (":-", "-", ":?", "?", ":+", "+"):
        raise _invalid(text, where)
    unset_or_empty = not value if op.startswith(":") else value is None
    if op.endswith("-"):
        return (substitute(arg, env, where) if unset_or_empty else value or ""), end + 1
    if op.endswith("+"):
        return ("" if unset_or_empty else substitute(arg, env, where)), end + 1
    if unset_or_empty:  # required
        why = substitute(arg, env, where) or f"variable {name} is required"
        raise InvalidRequest(f"compose {where or 'file'}: {why} (set it in composeEnv)")
    return value or "", end + 1


def _closing_brace(text: str, pos: int) -> int:
    depth = 1
    while pos < len(text):
        c = text[pos]
        if c == "$" and text[pos + 1 : pos + 2] == "$":
            pos += 2
            continue
        if c == "$" and text[pos + 1 : pos + 2] == "{":
            depth += 1
            pos += 2
            continue
        if c == "}":
            depth -= 1
            if depth == 0:
                return pos
        pos += 1
    return -1


def _invalid(text: str, where: str) -> InvalidRequest:
    shown = text if len(text) <= 80 else text[:77] + "..."
    return InvalidRequest(f"compose {where or 'file'}: invalid interpolation in {shown!r} (write a literal $ as $$)")


def escape(doc: Any) -> Any:
    """``doc`` with every ``$`` of its string values doubled: what Compose reads back unchanged."""
    if isinstance(doc, str):
        return doc.replace("$", "$$")
    if isinstance(doc, dict):
        return {k: escape(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [escape(v) for v in doc]
    return doc

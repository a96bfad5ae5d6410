"""One compose project from several layered files, as ``docker compose -f a -f b ...`` would see it.

Harbor describes a task's services as layers (its own ``main`` service, the task's
``docker-compose.yaml``, extra overlays, an environment overlay) and lets ``docker compose`` merge them.
aenv's compose route takes one project, so ``integrations/harbor_compose.py`` merges them first, here:
pure functions over parsed YAML (no Harbor, no YAML parser), unit-tested in aenv's own venv.

What is merged like Compose does: mappings recursively; ``environment``, ``labels``, ``extra_hosts``,
``annotations`` and ``sysctls`` by key (their ``KEY=VALUE`` list form too); ``depends_on`` by service (its
list form too); ``volumes`` and ``devices`` by target path; ``command``, ``entrypoint``, a healthcheck's
``test`` and every other scalar replaced by the later file; other lists (``ports``, ``expose``, ``dns``…)
appended without duplicates.

Interpolation substitutes only the variables it is given (``${VAR}``, ``${VAR:-default}``,
``${VAR-default}``, ``$VAR``) and leaves everything else as written, ``$$`` escapes included: Compose
interpolates the project again (aenv's route with ``composeEnv``, the CLI in an sdk-mode sandbox), and must
see what an unmerged file would have shown it. So a substituted value has its ``$`` doubled.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

KEYED_LISTS = frozenset({"environment", "labels", "extra_hosts", "annotations", "sysctls"})
BY_TARGET = frozenset({"volumes", "devices"})
REPLACED = frozenset({"command", "entrypoint", "test"})

_VAR = re.compile(r"\$(?:\$|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?-)(?P<default>[^}]*))?\}"
                  r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")  # fmt: skip


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """``value`` (a parsed YAML tree) with the variables of ``env`` substituted in every string, mapping
    keys included; a variable ``env`` lacks keeps its default if it has one, else stays as written."""
    if isinstance(value, str):
        return _VAR.sub(lambda m: _substitute(m, env), value)
    if isinstance(value, Mapping):
        return {interpolate(k, env): interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    return value


def _substitute(m: re.Match[str], env: Mapping[str, str]) -> str:
    name = m.group("braced") or m.group("bare")
    if name is None:  # "$$": an escape, kept for the compose CLI's own pass
        return m.group(0)
    if name in env:
        if m.group("op") == ":-" and env[name] == "":
            return m.group("default")
        return env[name].replace("$", "$$")  # a literal value: Compose's own pass must not expand it
    if m.group("op") is not None:
        return m.group("default")
    return m.group(0)


def merge_files(files: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The files merged in order (later wins); each a parsed compose file (``services``, ``volumes``…)."""
    out: dict[str, Any] = {}
    for f in files:
        out = _merge_map(out, f)
    return out


def _merge_map(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if key not in out or out[key] is None:
            out[key] = _normal(key, value)
        else:
            out[key] = _merge_value(key, out[key], value)
    return out


def _merge_value(key: str, old: Any, new: Any) -> Any:
    if new is None:
        return old
    if key in KEYED_LISTS:
        return {**_as_map(old), **_as_map(new)}
    if key == "depends_on":
        return _merge_map(_depends(old), _depends(new))
    if key in BY_TARGET and isinstance(old, list) and isinstance(new, list):
        merged = {_target(v): v for v in old}
        merged.update({_target(v): v for v in new})
        return list(merged.values())
    if key in REPLACED:
        return new
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        return _merge_map(old, new)
    if isinstance(old, list) and isinstance(new, list):
        return old + [v for v in new if v not in old]
    return new


def _normal(key: str, value: Any) -> Any:
    """A value seen for the first time, in the form later merges expect (keyed lists as mappings)."""
    if key in KEYED_LISTS and isinstance(value, list):
        return _as_map(value)
    if isinstance(value, Mapping) and key not in KEYED_LISTS:
        return _merge_map({}, value)
    return value


def _as_map(value: Any) -> dict[str, Any]:
    if isinstance(value, Mapping):
        return dict(value)
    out: dict[str, Any] = {}
    for item in value or []:
        k, sep, v = str(item).partition("=")
        if not sep and ":" in k and "=" not in k:  # extra_hosts' "host:ip" list form
            k, _, v = k.partition(":")
            sep = "="
        out[k] = v if sep else None
    return out


def _depends(value: Any) -> dict[str, Any]:
    if isinstance(value, Mapping):
        return dict(value)
    return {str(name): {"condition": "service_started"} for name in value or []}


def _target(volume: Any) -> str:
    """A volume's or device's target path: the key the merge replaces it by."""
    if isinstance(volume, Mapping):
        return str(volume.get("target", volume))
    parts = str(volume).split(":")
    return parts[1] if len(parts) > 1 else parts[0]

"""The REST reference: a FastAPI app's OpenAPI schema rendered as Markdown, grouped by resource.

The schema is the one ``/openapi.json`` serves, taken from the app object without starting its lifespan
(no store, runtime or orchestrator), so a route added to a router is documented by the next build.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

from aenv.refdocs.cli import prose

METHODS = ("get", "post", "put", "patch", "delete", "head", "options")


def fastapi_of(asgi: Any) -> Any:
    """The FastAPI app inside ``create_app``'s or ``create_gateway_app``'s ASGI wrappers (the sandbox
    proxy and any middleware in front of it hold the next app as ``.app``)."""
    app = asgi
    for _ in range(16):
        if hasattr(app, "openapi") and hasattr(app, "routes"):
            return app
        app = getattr(app, "app", None)
        if app is None:
            break
    raise TypeError(f"no FastAPI app inside {type(asgi).__name__}")


def node_schema() -> dict[str, Any]:
    """The node's (``aenv serve``) schema, from an app built on default settings and never started."""
    from aenv.api.app import create_app
    from aenv.config import Settings

    schema: dict[str, Any] = fastapi_of(create_app(Settings.model_validate({}))).openapi()
    return schema


def gateway_schema() -> dict[str, Any]:
    """The gateway's (``aenv gateway``) schema: its own routes; sandbox traffic is relayed, not routed."""
    from aenv.gateway.app import GatewaySettings, create_gateway_app

    app = fastapi_of(create_gateway_app(GatewaySettings(nodes=[])))
    with warnings.catch_warnings():  # one handler serves several methods (api_route): one operation ID
        warnings.filterwarnings("ignore", "Duplicate Operation ID", UserWarning)
        schema: dict[str, Any] = app.openapi()
    return schema


def operations(schema: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(METHOD, path, operation) for every operation, in the schema's order."""
    for path, item in schema.get("paths", {}).items():
        for method in METHODS:
            if method in item:
                yield method.upper(), path, item[method]


def group_of(path: str) -> str:
    """The resource a path is about: its first segment after a version (``/v2``) or ``/aenv`` prefix."""
    parts = [p for p in path.strip("/").split("/") if p]
    while parts and (parts[0] in ("v1", "v2", "v3") or parts[0] == "aenv") and len(parts) > 1:
        parts = parts[1:]
    if not parts:
        return "/"
    return "other paths" if parts[0].startswith("{") else parts[0]


def _cell(text: object) -> str:
    """Text that stays in one Markdown table cell."""
    return prose(" ".join(str(text).split()).replace("|", "\\|"))


def _ref_name(schema: dict[str, Any]) -> str:
    ref = schema.get("$ref", "")
    return str(ref).rsplit("/", 1)[-1] if ref else ""


def type_of(schema: dict[str, Any]) -> str:
    """A short type: ``string``, ``integer[]``, a schema's name, or ``a | b`` for unions."""
    if name := _ref_name(schema):
        return name
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " | ".join(type_of(s) for s in schema[key])
    if schema.get("type") == "array":
        return type_of(schema.get("items", {})) + "[]"
    if "enum" in schema:
        return " | ".join(repr(v) for v in schema["enum"])
    return str(schema.get("type", "any"))


def _body(op: dict[str, Any]) -> str:
    content = op.get("requestBody", {}).get("content", {})
    parts = []
    for media, spec in content.items():
        name = type_of(spec.get("schema", {}))
        link = f"[`{name}`](#{name.lower()})" if _ref_name(spec.get("schema", {})) else f"`{name}`"
        parts.append(f"{link} (`{media}`)")
    return ", ".join(parts)


def _operation(method: str, path: str, op: dict[str, Any]) -> list[str]:
    lines = [f"### `{method} {path}`", ""]
    summary = op.get("summary", "")
    description = (op.get("description") or "").strip()
    lines += [f"**{summary}**" if summary else "", ""]
    if description:
        lines += ["```text", description, "```", ""]
    params = op.get("parameters", [])
    if params:
        lines += ["| parameter | in | type | required | description |", "|---|---|---|---|---|"]
        for p in params:
            lines.append(
                f"| `{p['name']}` | {p.get('in', '')} | {_cell(type_of(p.get('schema', {})))} | "
                f"{'yes' if p.get('required') else ''} | {_cell(p.get('description', ''))} |"
            )
        lines.append("")
    if body := _body(op):
        lines += [f"Request body: {body}.", ""]
    responses = op.get("responses", {})
    if responses:
        lines += ["| status | description | body |", "|---|---|---|"]
        for code, resp in responses.items():
            schemas = [type_of(s.get("schema", {})) for s in resp.get("content", {}).values()]
            shown = ", ".join(f"`{s}`" for s in schemas if s != "any")
            lines.append(f"| {code} | {_cell(resp.get('description', ''))} | {_cell(shown)} |")
        lines.append("")
    return lines


def _schemas(schema: dict[str, Any]) -> list[str]:
    found = schema.get("components", {}).get("schemas", {})
    if not found:
        return []
    lines = ["## Schemas", ""]
    for name, spec in found.items():
        lines += [f"### {name}", ""]
        if doc := (spec.get("description") or "").strip():
            lines += [_cell(doc), ""]
        props = spec.get("properties", {})
        required = set(spec.get("required", []))
        if props:
            lines += ["| field | type | required | description |", "|---|---|---|---|"]
            for field, fspec in props.items():
                lines.append(f"| `{field}` | {_cell(type_of(fspec))} | {'yes' if field in required else ''} | "
                             f"{_cell(fspec.get('description', ''))} |")
            lines.append("")
    return lines


def render(schema: dict[str, Any], title: str, intro: str = "") -> str:
    """One page: a section per resource (method, path, summary, docstring, parameters, body,
    responses), then every request and response schema with its fields."""
    groups: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
    for method, path, op in operations(schema):
        tag = (op.get("tags") or [group_of(path)])[0]
        groups.setdefault(tag, []).append((method, path, op))
    lines = [f"# {title}", ""]
    if intro:
        lines += [intro, ""]
    for tag in sorted(groups):
        lines += [f"## {tag}", ""]
        for method, path, op in sorted(groups[tag], key=lambda o: (o[1], METHODS.index(o[0].lower()))):
            lines += _operation(method, path, op)
    lines += _schemas(schema)
    return "\n".join(lines).rstrip() + "\n"

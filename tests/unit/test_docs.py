"""The docs stay whole without building them (the test command runs ``mkdocs build --strict``):
the README stays a front door, its links resolve, every page is in the nav, and the generated
references cover every CLI command and every REST route."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from aenv.cli.main import app
from aenv.refdocs import cli, rest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
GENERATED = {"reference/cli.md", "reference/rest.md", "reference/gateway-rest.md", "reference/bench-runs.md"}
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _nav_pages(nav: Any) -> set[str]:
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, list):
        return set().union(*(_nav_pages(item) for item in nav)) if nav else set()
    if isinstance(nav, dict):
        return set().union(*(_nav_pages(v) for v in nav.values()))
    return set()


def test_readme_is_a_front_door() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) < 200


def test_readme_links_point_at_files() -> None:
    text = (ROOT / "README.md").read_text()
    targets = [t.split("#")[0] for t in LINK.findall(text) if "://" not in t and not t.startswith("#")]
    assert targets, "the README links to the docs pages"
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert missing == []


def test_nav_lists_every_page() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    on_disk = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert on_disk - nav == set(), "pages missing from mkdocs.yml's nav"
    assert nav - on_disk - GENERATED == set(), "nav entries with no page"
    assert GENERATED <= nav
    assert not (on_disk & GENERATED), "generated pages are never committed"


def test_cli_reference_covers_every_command() -> None:
    page = cli.render(app)
    commands = [c.path for c in cli.walk(app)]
    assert {"aenv serve", "aenv cluster local", "aenv template build", "aenv cache ls"} <= set(commands)
    for path in commands:
        assert f"`{path}`" in page, path


def test_cli_reference_shows_options_and_arguments() -> None:
    page = cli.render(app)
    assert "`--stop-sandboxes-on-exit`" in page and "`SANDBOX_ID`" in page and "`AENV_SERVER`" in page


@pytest.mark.parametrize("schema_of", [rest.node_schema, rest.gateway_schema], ids=["node", "gateway"])
def test_rest_reference_covers_every_route(schema_of: Any) -> None:
    schema = schema_of()
    page = rest.render(schema, "REST")
    ops = list(rest.operations(schema))
    assert len(ops) > 20
    for method, path, _ in ops:
        assert f"### `{method} {path}`" in page, (method, path)
    for name in schema.get("components", {}).get("schemas", {}):
        assert f"### {name}\n" in page


def test_rest_reference_of_the_node_has_the_e2b_routes() -> None:
    ops = {(m, p) for m, p, _ in rest.operations(rest.node_schema())}
    assert {("POST", "/sandboxes"), ("POST", "/v2/sandboxes"), ("GET", "/health")} <= ops


def test_group_of_strips_versions_and_the_aenv_prefix() -> None:
    assert rest.group_of("/v2/sandboxes/{sandbox_id}") == "sandboxes"
    assert rest.group_of("/aenv/leases/{lease_id}/heartbeat") == "leases"
    assert rest.group_of("/{rest}") == "other paths"
    assert rest.group_of("/health") == "health"


def test_bench_page_renders_every_committed_result() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts" / "mkdocs_hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    results = ROOT / "bench" / "results"
    found = hooks.committed_results(results)
    assert found, "bench/results/ holds committed runs"
    page = hooks.bench_page(results)
    for path in found:
        assert f"## `{path.parent.relative_to(results).as_posix()}`" in page

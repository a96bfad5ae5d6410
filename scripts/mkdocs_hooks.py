"""MkDocs hook: the pages generated from the code and the committed bench results, added at build time.

Never written into ``docs/``: the CLI reference (the Typer app), the REST references (the node's and the
gateway's OpenAPI schemas) and the bench runs (``bench/results/**/results.json`` through
``bench.report``) exist only in the built site, so they cannot go stale in the repository.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent

REST_INTRO = (
    "Generated from the node's OpenAPI schema (what `aenv serve` answers at `/openapi.json`) when the "
    "site is built (`src/aenv/refdocs/rest.py`). Sandbox traffic (envd, user ports) is not routed by "
    "FastAPI and is not listed: see [Ports, WebSocket, domain and HTTPS](../networking.md). Which E2B "
    "routes are served and how is in [E2B routes](../E2B_ROUTES.md)."
)
GATEWAY_INTRO = (
    "Generated from the gateway's routes (`aenv gateway`; it serves no `/openapi.json` itself) when the "
    "site is built. Routes about one sandbox are relayed to its node, lists merged over the live nodes: "
    "see [Many machines](../cluster.md)."
)


def committed_results(results_dir: Path) -> list[Path]:
    """The results JSON files git tracks (bench/results/ is ignored: a local run's output stays out of
    the site); every one on disk where there is no git checkout."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--", str(results_dir)],
                             capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return sorted(results_dir.glob("**/results.json"))
    return sorted(ROOT / f for f in out.split("\0") if f.endswith("/results.json"))


def bench_page(results_dir: Path) -> str:
    """Every committed results JSON, rendered by ``bench.report`` as the bench itself renders it."""
    if str(ROOT) not in sys.path:  # bench/ is a package of the checkout, not of aenv (and MkDocs puts
        sys.path.insert(0, str(ROOT))  # sys.path back after loading a hook, so not at import time)
    from bench.report import render_markdown

    lines = [
        "# Bench runs",
        "",
        "Generated when the site is built from every `results.json` committed under `bench/results/`, "
        "by `bench.report` (the tables `python -m bench` prints). The hand-written reading of the "
        "numbers, with the whole-suite run, is in [Results](../results.md).",
        "",
    ]
    for path in committed_results(results_dir):
        name = path.parent.relative_to(results_dir).as_posix()
        lines += [f"## `{name}`", "", render_markdown(json.loads(path.read_text()), heading="###"), ""]
    return "\n".join(lines)


def generated_pages() -> dict[str, str]:
    """src_uri → Markdown of every generated page."""
    from aenv.cli.main import app
    from aenv.refdocs import cli, rest

    return {
        "reference/cli.md": cli.render(app),
        "reference/rest.md": rest.render(rest.node_schema(), "REST API (node)", REST_INTRO),
        "reference/gateway-rest.md": rest.render(rest.gateway_schema(), "REST API (gateway)", GATEWAY_INTRO),
        "reference/bench-runs.md": bench_page(ROOT / "bench" / "results"),
    }


def on_files(files: Files, config: Any) -> Files:
    for uri, text in generated_pages().items():
        files.append(File.generated(config, uri, content=text))
    return files

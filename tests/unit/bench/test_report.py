"""The bench's pure parts: scenario selection, alternation, row shapes, Markdown and Results-page rendering."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.__main__ import GROUPS, SCENARIOS, select
from bench.report import END, START, main, render_markdown, update_page
from bench.rows import alternate, row, scenario, value_row


def test_select_groups_names_and_order() -> None:
    # rl's rows already hold rl-groups'; lazy starts its own registry and servers, run by name
    assert select("all") == [s for s in SCENARIOS if s not in ("rl-groups", "lazy", "cluster", "cluster-sim", "chaos",
                                                                "scale", "interpreter", "bandwidth", "teams", "console",
                                                                "compose", "console-sim")]
    assert select("cluster-sim") == ["cluster-sim"]
    assert select("console-sim") == ["console-sim"]
    assert select("chaos") == ["chaos"]
    assert select("compose") == ["compose"]
    assert select("scale") == ["scale"]
    assert select("console") == ["console"]
    assert select("interpreter") == ["interpreter"]
    assert select("rl-groups") == ["rl-groups"]
    assert select("lazy") == ["lazy"]
    assert select("rl,create") == ["create", "rl"]  # SCENARIOS order, not argument order
    assert select("snapshots") == GROUPS["snapshots"]
    with pytest.raises(ValueError, match="unknown scenario 'nope'"):
        select("core,nope")


def test_alternate_flips_order_and_caps_slow_systems() -> None:
    calls: list[str] = []

    def sampler(name: str) -> Any:
        return lambda: calls.append(name) or 1.0

    out = alternate(4, [("a", sampler("a")), ("b", sampler("b"))], limits={"b": 1})
    assert calls == ["a", "b", "a", "a", "a"]
    assert len(out["a"]) == 4 and len(out["b"]) == 1


def test_row_percentiles_are_ordered_and_empty_rows_have_no_samples() -> None:
    r = row("m", "aenv-ns", [5.0, 1.0, 3.0, 2.0, 4.0])
    assert (r["n"], r["min"], r["p50"], r["max"]) == (5, 1.0, 3.0, 5.0)
    assert r["min"] <= r["p50"] <= r["p95"] <= r["p99"] <= r["max"]
    assert row("m", "docker", [])["n"] == 0
    v = value_row("fit", "aenv-ns", 223.84, 3, "count")
    assert v["p50"] == v["p99"] == 223.8


def _results() -> dict[str, Any]:
    sc = scenario("create", [row("create → first command", "aenv-ns", [10.0, 12.0]),
                             row("create → first command", "docker", [300.0, 320.0], note="docker run")])
    return {
        "meta": {"date": "2026-11-30T12:00:00+00:00", "machine": "test box", "os": "Debian", "git": "abc",
                 "load_before": [0.5, 0.6, 0.7], "load_after": [0.8, 0.7, 0.7], "mode": "full", "wall_s": 1.0,
                 "command": "python -m bench", "versions": {"docker": "Docker 28"}},
        "runs": {"ns": {"scenarios": {"create": sc}, "errors": {}},
                 "vm": {"skipped": "no qemu"}},
    }  # fmt: skip


def test_markdown_has_ratio_load_and_skips() -> None:
    md = render_markdown(_results())
    assert "| create → first command | docker | 310.0 |" in md
    assert "28.2×" in md  # 310 / 11
    assert "0.5/0.6/0.7 before" in md
    assert "Skipped: no qemu" in md


def test_update_page_replaces_only_between_markers(tmp_path: Path) -> None:
    page = tmp_path / "results.md"
    page.write_text(f"# x\n\n## Results\n\nintro\n\n{START}\nold\n{END}\n\nprose after\n")
    update_page(page, "new table")
    update_page(page, "newer table")
    text = page.read_text()
    assert "newer table" in text and "old" not in text and "new table\n" not in text
    assert text.count(START) == 1 and text.endswith("prose after\n")
    bare = tmp_path / "BARE.md"
    bare.write_text("# y\n")
    update_page(bare, "t")
    assert "## Results" in bare.read_text() and START in bare.read_text()


def test_page_flag_and_its_old_name_update_the_results_page(tmp_path: Path) -> None:
    import json

    results = tmp_path / "results.json"
    results.write_text(json.dumps(_results()))
    for flag in ("--page", "--readme"):
        page = tmp_path / f"page{flag}.md"
        page.write_text(f"# Results\n\n{START}\nold\n{END}\n")
        assert main([str(results), flag, str(page)]) == 0
        assert "| create → first command | docker | 310.0 |" in page.read_text() and "old" not in page.read_text()


def test_docs_results_page_has_the_markers() -> None:
    text = (Path(__file__).resolve().parents[3] / "docs" / "results.md").read_text()
    assert text.count(START) == 1 and text.count(END) == 1

"""The gateway's merges of the console's read routes: summaries summed, graphs joined."""

from __future__ import annotations

from aenv.gateway.console_reads import merge_graphs, merge_summaries


def test_summaries_are_summed_per_state_template_run_and_node() -> None:
    n1 = {"total": 3, "byState": {"running": 2, "paused": 1}, "byTemplate": {"base": 3}, "runKey": "run",
          "byRun": {"r1": {"running": 2}}}  # fmt: skip
    n2 = {"total": 1, "byState": {"running": 1}, "byTemplate": {"base": 1}, "runKey": "run", "byRun": {"r1": {"running": 1}}}
    out = merge_summaries({"n1": n1, "n2": n2})
    assert out["total"] == 4 and out["byState"] == {"running": 3, "paused": 1} and out["byTemplate"] == {"base": 4}
    assert out["byRun"] == {"r1": {"running": 3}} and out["byNode"] == {"n1": 3, "n2": 1} and out["runKey"] == "run"


def test_graphs_are_joined_with_each_node_named_and_templates_once() -> None:
    t = {"kind": "template", "id": "template:base", "templateID": "base"}
    g1 = {"nodes": [t, {"kind": "sandbox", "id": "a"}], "edges": [{"source": "template:base", "target": "a"}]}
    g2 = {"nodes": [t, {"kind": "sandbox", "id": "b"}], "edges": [{"source": "template:base", "target": "b"}],
          "truncated": True}  # fmt: skip
    out = merge_graphs({"n1": g1, "n2": g2})
    assert [n["id"] for n in out["nodes"]] == ["template:base", "a", "b"]
    assert {n["id"]: n.get("node") for n in out["nodes"]} == {"template:base": None, "a": "n1", "b": "n2"}
    assert len(out["edges"]) == 2 and out["truncated"] is True

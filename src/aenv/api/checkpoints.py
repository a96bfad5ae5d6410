"""The checkpoint tree as a graph, for the console: template → snapshots → sandboxes.

A snapshot's parent is the snapshot its sandbox's state descended from when it was taken (its lineage
head), so snapshots form a forest by ``parentID``; a root snapshot hangs off its template. A live sandbox
is a leaf under its own lineage head (a fork child under the fork point it started from, a rolled-back
sandbox under the snapshot it went back to, a sandbox snapshotted just now under that snapshot), or under
its template when it has none. Fork points (internal snapshots) are nodes too: they are where a group's
children branch.

Pure functions over JSON-shaped dicts, so a gateway can join what its nodes send and draw the same graph.
"""

from __future__ import annotations

from typing import Any

MAX_NODES = 5000  # a page draws at most this many; the answer says when it cut


def graph(snapshots: list[dict[str, Any]], sandboxes: list[dict[str, Any]], root: str | None) -> dict[str, Any]:
    """Nodes and edges; with ``root`` (a sandbox or snapshot ID) only the tree that holds it."""
    snap_ids = {s["id"] for s in snapshots}
    # each item's parent key: a snapshot's parent snapshot, a sandbox's lineage head
    kinds = (("snapshot", snapshots, "parentID"), ("sandbox", sandboxes, "lineageHead"))
    links: dict[str, set[str]] = {}
    for _, items, up in kinds:
        for item in items:
            links.setdefault(item["id"], set())
            if isinstance(parent := item.get(up), str) and parent in snap_ids:
                links.setdefault(parent, set()).add(item["id"])
                links[item["id"]].add(parent)
    keep = _component(links, root) if root else set(links)
    nodes: list[dict[str, Any]] = []
    edges: list[dict[str, Any]] = []
    templates: set[str] = set()
    for kind, items, up in kinds:
        for item in items:
            if item["id"] not in keep:
                continue
            nodes.append({"kind": kind, **item})
            parent = item.get(up) if item.get(up) in snap_ids else None
            if parent is None:  # a root hangs off its template
                templates.add(item["templateID"])
                parent = "template:" + item["templateID"]
            edges.append({"source": parent, "target": item["id"]})
    nodes[:0] = [{"kind": "template", "id": "template:" + t, "templateID": t} for t in sorted(templates)]
    cut = len(nodes) > MAX_NODES
    if cut:
        nodes = nodes[:MAX_NODES]
        ids = {n["id"] for n in nodes}
        edges = [e for e in edges if e["source"] in ids and e["target"] in ids]
    return {"nodes": nodes, "edges": edges, "truncated": cut}


def _component(links: dict[str, set[str]], root: str) -> set[str]:
    if root not in links:
        return set()
    seen, todo = {root}, [root]
    while todo:
        for other in links[todo.pop()]:
            if other not in seen:
                seen.add(other)
                todo.append(other)
    return seen

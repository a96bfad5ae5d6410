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
    links: dict[str, set[str]] = {}

    def link(a: str, b: str) -> None:
        links.setdefault(a, set()).add(b)
        links.setdefault(b, set()).add(a)

    for s in snapshots:
        links.setdefault(s["id"], set())
        if s.get("parentID") in snap_ids:
            link(s["parentID"], s["id"])
    for x in sandboxes:
        links.setdefault(x["id"], set())
        if x.get("lineageHead") in snap_ids:
            link(x["lineageHead"], x["id"])
    keep = _component(links, root) if root else set(links)
    nodes: list[dict[str, Any]] = []
    edges: list[dict[str, Any]] = []
    templates: set[str] = set()
    for s in snapshots:
        if s["id"] not in keep:
            continue
        nodes.append({"kind": "snapshot", **s})
        parent = s.get("parentID") if s.get("parentID") in snap_ids else None
        if parent is None:
            templates.add(s["templateID"])
            parent = "template:" + s["templateID"]
        edges.append({"source": parent, "target": s["id"]})
    for x in sandboxes:
        if x["id"] not in keep:
            continue
        nodes.append({"kind": "sandbox", **x})
        head = x.get("lineageHead") if x.get("lineageHead") in snap_ids else None
        if head is None:
            templates.add(x["templateID"])
            head = "template:" + x["templateID"]
        edges.append({"source": head, "target": x["id"]})
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

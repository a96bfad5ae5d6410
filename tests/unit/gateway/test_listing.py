"""Paging a list merged over nodes: every item once, in order, however the pages fall."""

from __future__ import annotations

import pytest

from aenv.gateway.listing import Positions, merge_page

KEYS = ("startedAt", "sandboxID")


def _node(name: str, times: list[int]) -> list[dict[str, str]]:
    """A node's sandboxes, newest first, as the node lists them."""
    return [{"sandboxID": f"{name}-{t}", "startedAt": f"2026-12-02T00:00:{t:02d}.000000Z"} for t in sorted(times, reverse=True)]


def _page(node: list[dict[str, str]], after: str | None, limit: int) -> tuple[list[dict[str, str]], bool]:
    """What the node answers: ``limit`` after ``after``, and whether it has more (its X-Next-Token)."""
    ids = [s["sandboxID"] for s in node]
    rest = node[ids.index(after) + 1 :] if after in ids else node
    return rest[:limit], len(rest) > limit


def _walk(nodes: dict[str, list[dict[str, str]]], limit: int) -> list[list[str]]:
    pages: list[list[str]] = []
    token: str | None = None
    while True:
        pos = Positions.decode(token)
        asked = {n: _page(items, pos.after.get(n), limit) for n, items in nodes.items() if n not in pos.done}
        items, after = merge_page(asked, pos, KEYS, True, limit)
        pages.append([s["sandboxID"] for s in items])
        if all(n in after.done for n in asked):
            return pages
        token = after.encode()


@pytest.mark.parametrize("limit", [1, 2, 3, 5, 100])
def test_every_item_once_newest_first(limit: int) -> None:
    nodes = {"n1": _node("n1", [1, 4, 5, 9]), "n2": _node("n2", [2, 3, 8]), "n3": _node("n3", [])}
    pages = _walk(nodes, limit)
    flat = [sid for page in pages for sid in page]
    assert flat == ["n1-9", "n2-8", "n1-5", "n1-4", "n2-3", "n2-2", "n1-1"]
    assert all(len(p) <= limit for p in pages)
    assert len(pages) == max(1, -(-len(flat) // limit))  # no empty page at the end when it divides evenly


def test_a_token_not_of_a_gateway_is_refused() -> None:
    for bad in ("abc", "gw1.!!!", "gw1." + "e30"):  # the last is '{}': no positions in it
        with pytest.raises(ValueError):
            Positions.decode(bad)
    assert Positions.decode(None) == Positions()
    pos = Positions({"n1": "a", "n2": None}, {"n3"})
    assert Positions.decode(pos.encode()) == pos

"""Lists merged over nodes, page by page: each node pages its own sandboxes (``nextToken`` = the last ID it
gave), so the gateway's token holds one position per node.

A page asks every live node for ``limit`` items after its position, merges them in the nodes' own order
(by ``startedAt``, newest first unless ``order=asc``) and keeps the first ``limit``. Whatever a node gave
that did not make the page comes after everything it gave that did, so its position becomes the last of
its items on the page. A node is done when it said it had no more and all it gave made the page; the
token ends when every node is done. A node that is down is skipped (and named by the caller); it joins
again from where it was.

Pure functions over JSON items, so the paging is tested without nodes.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

PREFIX = "gw1."


@dataclass
class Positions:
    """Where each node's next page starts: after this ID (None: from its start); ``done`` nodes have no more."""

    after: dict[str, str | None] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)

    def encode(self) -> str:
        raw = json.dumps({"a": self.after, "d": sorted(self.done)}, separators=(",", ":")).encode()
        return PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")

    @classmethod
    def decode(cls, token: str | None) -> Positions:
        """The positions a token holds; raises ValueError for one this gateway did not write."""
        if not token:
            return cls()
        if not token.startswith(PREFIX):
            raise ValueError("not a gateway page token")
        body = token[len(PREFIX):]
        try:
            data = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
            return cls({str(k): v for k, v in data["a"].items()}, {str(d) for d in data["d"]})
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError("not a gateway page token") from None


def merge_page(
    pages: dict[str, tuple[list[dict[str, Any]], bool]], before: Positions, keys: tuple[str, str], descending: bool,
    limit: int,
) -> tuple[list[dict[str, Any]], Positions]:
    """The merged page and the positions after it. ``pages``: per node asked, its items and whether it
    said it has more (an ``X-Next-Token``); ``keys``: the field the nodes sort by and the ID field."""
    sort_key, id_key = keys
    tagged = [(node, i, item) for node, (items, _) in pages.items() for i, item in enumerate(items)]
    tagged.sort(key=lambda t: str(t[2].get(sort_key, "")), reverse=descending)  # stable: each node's order kept
    taken = tagged[:limit]
    after = dict(before.after)
    done = set(before.done)
    for node, (items, more) in pages.items():
        mine = [t for t in taken if t[0] == node]
        if mine:
            after[node] = str(mine[-1][2].get(id_key, ""))
        if not more and len(mine) == len(items):
            done.add(node)
    return [t[2] for t in taken], Positions(after, done)

"""``aenv ls`` for many sandboxes: the rows a person reads in an 80-column terminal.

An RL run starts hundreds of sandboxes at once, so the listing is built to be grepped and piped:
full IDs always (an ID is what every other command takes; a truncated one is useless), times as
"3 min ago" / "in 4 min" (absolute timestamps of one burst all look alike), metadata filters that
the server applies (``--metadata run=X``), and ``-q`` for IDs only (``aenv rm $(aenv ls -q ...)``).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import urlencode

COUNT_LINE_AFTER = 20  # rows above which a count line follows the table


def parse_metadata(pairs: Sequence[str]) -> dict[str, str]:
    """``["run=r1", "k=v"]`` → a dict; a pair without ``=`` (or with an empty key) is a ValueError naming it."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--metadata '{pair}' is not KEY=VALUE")
        out[key] = value
    return out


def metadata_query(metadata: dict[str, str]) -> str:
    """The ``metadata`` query value as the E2B SDKs send it (``k=v&k2=v2``, each part URL-encoded)."""
    return urlencode(metadata)


def _parse_iso(value: str) -> dt.datetime:
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


def relative(value: str | None, now: dt.datetime) -> str:
    """An ISO timestamp relative to ``now``: "just now", "42 s ago", "3 min ago", "in 4 min", "2 h ago"."""
    if not value:
        return "-"
    try:
        delta = (_parse_iso(value) - now).total_seconds()
    except ValueError:
        return value
    seconds = abs(delta)
    if seconds < 2:
        return "just now" if delta <= 0 else "now"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60), ("s", 1)):
        if seconds >= size:
            amount = f"{int(seconds // size)} {unit}"
            return f"in {amount}" if delta > 0 else f"{amount} ago"
    return "now"  # pragma: no cover - the loop always returns for seconds >= 1


def _metadata_text(metadata: Any) -> str:
    if not isinstance(metadata, dict) or not metadata:
        return ""
    return ",".join(f"{k}={v}" for k, v in metadata.items())  # as the client gave them


COLUMNS = ("SANDBOX ID", "TEMPLATE", "STATE", "STARTED", "ENDS", "METADATA")


def rows(items: Iterable[dict[str, Any]], now: dt.datetime | None = None) -> list[tuple[str, ...]]:
    """One row per sandbox of ``GET /v2/sandboxes``; ENDS is when it expires (running) or paused (paused)."""
    now = now or dt.datetime.now(dt.UTC)
    out: list[tuple[str, ...]] = []
    for s in items:
        ends = relative(s.get("endAt"), now)
        if s.get("state") == "paused":
            ends = "paused"
        out.append((s["sandboxID"], s.get("alias") or s.get("templateID", ""), s.get("state", ""),
                    relative(s.get("startedAt"), now), ends, _metadata_text(s.get("metadata"))))
    return out


def count_line(items: Sequence[dict[str, Any]]) -> str:
    """"214 sandboxes: 200 running, 14 paused"."""
    by_state: dict[str, int] = {}
    for s in items:
        by_state[s.get("state", "?")] = by_state.get(s.get("state", "?"), 0) + 1
    parts = ", ".join(f"{n} {state}" for state, n in sorted(by_state.items()))
    return f"{len(items)} sandbox{'es' if len(items) != 1 else ''}" + (f": {parts}" if parts else "")

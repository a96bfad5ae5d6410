"""What the console bench measures with, apart from the browser: the open-loop pacer's schedule, the
row-shown delays, the rates and spreads of its notes, and a separate reader of ``/aenv/events`` (the
server's part of a row's delay). Pure parts are unit-tested (``tests/unit/bench/test_console.py``)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from bench.rows import pct

SHOW_S = 10.0  # a created sandbox's row must show within this


# ---- pure parts (unit-tested) ------------------------------------------------------------------------
def schedule(rate: float, n: int) -> list[float]:
    """An open-loop pacer's start offsets (s): ``n`` starts, evenly ``1/rate`` apart from 0."""
    return [i / rate for i in range(n)]


def show_delays(created: Mapping[str, float], seen: Mapping[str, float], within_ms: float = SHOW_S * 1000
                ) -> tuple[list[float], list[str]]:
    """Per created sandbox (its 201 in epoch ms), the ms until its row was first seen (epoch ms), and the
    IDs not seen within ``within_ms``. A row may show a little before the client got the 201 (the event
    goes out as the server answers): such delays stay negative, as measured."""
    delays, missing = [], []
    for sid, at in created.items():
        shown = seen.get(sid)
        if shown is None or shown - at > within_ms:
            missing.append(sid)
        else:
            delays.append(shown - at)
    return delays, missing


class SseParser:
    """Server-Sent Events, line by line: ``feed(line)`` returns ``(event, data)`` when a blank line ends
    one (comments and ``retry:`` lines alone give nothing)."""

    def __init__(self) -> None:
        self.event, self.data = "", []  # type: tuple[str, list[str]]

    def feed(self, line: str) -> tuple[str, str] | None:
        line = line.rstrip("\r\n")
        if not line:
            out = (self.event or "message", "\n".join(self.data)) if self.data else None
            self.event, self.data = "", []
            return out
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            self.event = value
        elif name == "data":
            self.data.append(value)
        return None


def rate_of(stamps: Iterable[float]) -> float:
    """Events per second over the span of ``stamps`` (seconds): n-1 intervals; 0 for fewer than two."""
    s = sorted(stamps)
    return (len(s) - 1) / (s[-1] - s[0]) if len(s) > 1 and s[-1] > s[0] else 0.0


def spread_note(values: list[float], unit: str = "ms") -> str:
    """p50/p95/max of ``values`` for a note ('–' for none)."""
    if not values:
        return "–"
    return f"p50 {pct(values, 50):.0f} / p95 {pct(values, 95):.0f} / max {max(values):.0f} {unit}"


@dataclass
class Events:
    """A separate SSE stream of ``/aenv/events``, read in a thread: each event's kind (a lifecycle event's
    own: created, killed, ...; else the SSE event's name: resync), its sandbox and its arrival (epoch ms)."""

    url: str
    key: str
    got: list[tuple[str, str, float]] = field(default_factory=list)
    error: str = ""
    _client: Any = None
    _thread: threading.Thread | None = None
    _open: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Events:
        import httpx

        self._client = httpx.Client(base_url=self.url, headers={"X-API-KEY": self.key}, trust_env=False,
                                    timeout=httpx.Timeout(10, read=None))
        self._thread = threading.Thread(target=self._read, name="console-sse", daemon=True)
        self._thread.start()
        self._open.wait(10)
        return self

    def _read(self) -> None:
        parser = SseParser()
        try:
            with self._client.stream("GET", "/aenv/events") as resp:
                self._open.set()
                for line in resp.iter_lines():
                    got = parser.feed(line)
                    if got is not None:
                        data = json.loads(got[1]) if got[1].startswith("{") else {}
                        kind = str(data.get("event") or got[0]) if got[0] == "lifecycle" else got[0]
                        self.got.append((kind, str(data.get("sandboxID", "")), time.time() * 1000))
        except Exception as exc:  # noqa: BLE001 - closing the client ends the stream; anything else is reported
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._open.set()

    def __exit__(self, *exc: object) -> None:
        self._client.close()
        if self._thread is not None:
            self._thread.join(5)

    def arrivals(self, kind: str = "created") -> dict[str, float]:
        """The first arrival (epoch ms) of each sandbox's lifecycle event of ``kind``."""
        out: dict[str, float] = {}
        for event, sid, at in list(self.got):
            if event == kind and sid and sid not in out:
                out[sid] = at
        return out

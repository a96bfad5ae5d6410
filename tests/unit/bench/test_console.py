"""The console scenario's pure parts: its knobs, the pacer's schedule, the created → shown delays, the SSE
parser the bench's own event stream reads with, and the rate and note helpers."""

from __future__ import annotations

import pytest

from bench.console import Knobs
from bench.console_probe import SseParser, rate_of, schedule, show_delays, spread_note


def test_knobs_default_smoke_and_env() -> None:
    full, smoke = Knobs.from_env(False, {}), Knobs.from_env(True, {})
    assert (full.count, full.rate, full.live_s, full.samples) == (2000, 100, 10, 10)
    assert full.live_creates == 1000
    assert smoke.count == 20 and smoke.live_s == 2 and smoke.live_creates == 200 and smoke.samples < full.samples
    mine = Knobs.from_env(False, {"AENV_BENCH_CONSOLE_COUNT": "500", "AENV_BENCH_CONSOLE_RATE": "20",
                                  "AENV_BENCH_CONSOLE_LIVE_S": "5", "AENV_BENCH_CONSOLE_FLOOR": "0.25"})
    assert (mine.count, mine.rate, mine.live_creates, mine.floor) == (500, 20, 100, 0.25)
    with pytest.raises(ValueError, match="AENV_BENCH_CONSOLE"):
        Knobs.from_env(False, {"AENV_BENCH_CONSOLE_RATE": "0"})
    with pytest.raises(ValueError, match="AENV_BENCH_CONSOLE"):
        Knobs.from_env(False, {"AENV_BENCH_CONSOLE_FLOOR": "1"})


def test_schedule_is_evenly_spaced_from_zero() -> None:
    assert schedule(100, 3) == [0.0, 0.01, 0.02]
    assert schedule(4, 0) == []
    offsets = schedule(100, 1000)
    assert offsets[-1] == pytest.approx(9.99) and len(offsets) == 1000


def test_show_delays_keeps_negative_and_counts_missing_and_late() -> None:
    created = {"a": 1000.0, "b": 2000.0, "c": 3000.0, "d": 4000.0}
    seen = {"a": 1500.0, "b": 1990.0, "d": 4000.0 + 10_001, "x": 5.0}  # c never shown, d too late, x not ours
    delays, missing = show_delays(created, seen)
    assert delays == [500.0, -10.0]
    assert sorted(missing) == ["c", "d"]
    assert show_delays(created, seen, within_ms=20_000)[1] == ["c"]
    assert show_delays({}, seen) == ([], [])


def test_sse_parser_events_comments_and_multiline_data() -> None:
    p = SseParser()
    lines = ["retry: 2000", "", ": keepalive", "", "event: lifecycle", 'data: {"event":"created"}', "",
             "event: resync", "data: {}", "", "data: one", "data:two", ""]
    got = [e for e in (p.feed(line) for line in lines) if e is not None]
    assert got == [("lifecycle", '{"event":"created"}'), ("resync", "{}"), ("message", "one\ntwo")]
    assert p.feed("event: x\r\n") is None and p.feed("\r\n") is None  # no data: nothing dispatched


def test_rate_and_note() -> None:
    assert rate_of([0.0, 0.5, 1.0]) == 2.0
    assert rate_of([3.0]) == 0.0 and rate_of([1.0, 1.0]) == 0.0
    assert spread_note([]) == "–"
    assert spread_note([1.0, 2.0, 3.0]) == "p50 2 / p95 3 / max 3 ms"

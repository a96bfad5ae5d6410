"""The scale scenario's pure parts: its knobs, the stop condition, a step's record, the ramp's bookkeeping
(every create recorded for the clean-up, a failure ending the ramp) and the chart's series lookup."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench import report, scale
from bench.scale import (
    Knobs,
    Ramp,
    each_row,
    meminfo,
    over,
    series_note,
    spread,
    step_record,
    stop_reason,
    used_kb,
)

MEMINFO = """MemTotal:       24000000 kB
MemFree:        10000000 kB
MemAvailable:   20000000 kB
Buffers:          100000 kB
Cached:          2000000 kB
SReclaimable:     400000 kB
HugePages_Total:       0
"""


def test_knobs_default_smoke_and_env() -> None:
    full, smoke = Knobs.from_env(False, {}), Knobs.from_env(True, {})
    assert (full.cap, full.step, full.forks, full.docker_cap, full.floor) == (2000, 50, 64, None, 0.5)
    assert smoke.cap < 10 and smoke.forks <= 4 and smoke.ksm_wait < full.ksm_wait
    mine = Knobs.from_env(False, {"AENV_BENCH_SCALE_MAX": "200", "AENV_BENCH_SCALE_FORKS": "32",
                                  "AENV_BENCH_SCALE_DOCKER_MAX": "100", "AENV_BENCH_SCALE_FLOOR": "0.3"})
    assert (mine.cap, mine.forks, mine.docker_cap, mine.floor) == (200, 32, 100, 0.3)
    with pytest.raises(ValueError, match="AENV_BENCH_SCALE"):
        Knobs.from_env(False, {"AENV_BENCH_SCALE_FLOOR": "1.5"})


def test_meminfo_parses_kb_and_used_is_free_s() -> None:
    mem = meminfo(MEMINFO)
    assert mem["MemAvailable"] == 20000000 and mem["HugePages_Total"] == 0
    assert used_kb(mem) == 24000000 - 10000000 - 100000 - 2000000 - 400000
    assert meminfo()["MemTotal"] > 0  # this host's


def test_stop_reason_cap_floor_and_first_step() -> None:
    assert stop_reason(0, 10, 100, 1000, 0.5) is None  # past the floor already: one step all the same
    assert stop_reason(5, 10, 600, 1000, 0.5) is None
    assert "50%" in (stop_reason(5, 10, 500, 1000, 0.5) or "")
    assert "cap of 10" in (stop_reason(10, 10, 900, 1000, 0.5) or "")


def test_step_record_and_memory_per_sandbox() -> None:
    base = meminfo(MEMINFO)
    now = {**base, "MemAvailable": base["MemAvailable"] - 100 * 1024, "MemFree": base["MemFree"] - 80 * 1024}
    rec = step_record(10, [5.0, 1.0, 3.0, 100.0], now, base, 12.34, {"server_rss_mb": 90.0})
    assert rec["count"] == 10 and rec["create_p50_ms"] == 4.0 and rec["create_p99_ms"] == 100.0
    assert rec["host_mb_each"] == 10.0 and rec["used_mb_each"] == 8.0
    assert rec["elapsed_s"] == 12.3 and rec["server_rss_mb"] == 90.0
    r = each_row("m", "aenv-ns", base, now, 10, "why")
    assert r["p50"] == 10.0 and r["n"] == 10 and r["unit"] == "MB" and "grew 8.0 MB each" in r["note"]


def test_over_counts_the_tail_past_a_target() -> None:
    assert over([1.0, 8.0, 8.5, 30.0], 8.0) == "2 of 4 above 8 MB"


def test_spread_keeps_ends_and_size() -> None:
    items = list(range(101))
    assert spread(items, 5) == [0, 25, 50, 75, 100]
    assert spread(items[:3], 5) == [0, 1, 2] and spread(items, 1) == [0]
    steps = [{"count": c, "create_p50_ms": 10.0, "create_p99_ms": 20.0, "host_mb_each": 7.25} for c in (50, 100)]
    assert series_note("aenv-ns", steps) == "aenv-ns by count (create p50/p99, host memory each): 50: 10/20 ms, 7.2 MB, 100: 10/20 ms, 7.2 MB"


def _knobs(cap: int, step: int) -> Knobs:
    return Knobs(cap=cap, step=step, forks=1, docker_cap=None, ksm_wait=1.0, floor=0.01, threads=3)


def test_ramp_steps_to_the_cap_recording_every_id() -> None:
    made = iter(range(1000))
    lock = threading.Lock()

    def create(record: Callable[[str], None]) -> float:
        with lock:
            record(f"id{next(made)}")
        return 2.0

    ramp = Ramp("fake")
    ramp.run(create, _knobs(cap=7, step=3), 7, lambda: {"probe": 1})
    assert [s["count"] for s in ramp.steps] == [3, 6, 7]
    assert len(set(ramp.ids)) == 7 and "cap of 7" in ramp.reason
    assert all(s["probe"] == 1 for s in ramp.steps)
    rows = ramp.rows("things")
    assert rows[0]["p50"] == 7 and rows[1]["note"] == "things 1-3" and rows[2]["note"] == "things 7-7"


def test_ramp_stops_at_a_failed_create_and_keeps_what_it_made() -> None:
    calls = iter(range(1000))
    lock = threading.Lock()

    def create(record: Callable[[str], None]) -> float:
        with lock:
            i = next(calls)
        if i == 4:
            raise RuntimeError("429 capacity")
        record(f"id{i}")
        return 1.0

    ramp = Ramp("fake")
    ramp.run(create, _knobs(cap=100, step=3), 100, dict)
    assert len(ramp.ids) == 5 and "failed at 5: RuntimeError: 429 capacity" in ramp.reason
    assert [s["count"] for s in ramp.steps] == [3, 5]


def test_ramp_waits_for_ksmd_at_the_floor_once_per_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the memory floor the ramp lets ksmd merge (``settle``) and goes on while that lifts it; the
    same count at the floor twice ends it."""
    available = {"kb": 900}  # of 1,000: above a 50 % floor until three sandboxes are made
    monkeypatch.setattr(scale, "meminfo", lambda text=None: {"MemTotal": 1000, "MemAvailable": available["kb"],
                                                             "MemFree": available["kb"]})
    made: list[str] = []

    def create(record: Callable[[str], None]) -> float:
        record(f"id{len(made)}")
        made.append("x")
        available["kb"] -= 150
        return 1.0

    settles: list[int] = []

    def settle() -> None:
        settles.append(len(made))
        if len(settles) == 1:
            available["kb"] += 400  # the first wait merges enough for more

    ramp = Ramp("fake")
    ramp.run(create, Knobs(cap=100, step=1, forks=1, docker_cap=None, ksm_wait=1.0, floor=0.5, threads=1), 100,
             dict, settle=settle)
    assert settles == [3, 6] and len(ramp.ids) == 6 and ramp.settles == 2
    assert "MemAvailable" in ramp.reason and "waited for ksmd 2×" in ramp.rows("sandboxes")[0]["note"]


def test_scale_series_found_and_chart_needs_them(tmp_path: Path) -> None:
    steps = [{"count": 3, "create_p50_ms": 1.0, "create_p99_ms": 2.0, "host_mb_each": 5.0, "server_rss_mb": 80.0}]
    results: dict[str, Any] = {"meta": {"date": "2026-12-06T00:00:00+00:00", "mode": "smoke"},
                               "runs": {"ns": {"scenarios": {"scale": {"rows": [], "series": {"aenv-ns": steps}},
                                                             "create": {"rows": []}}}}}
    assert report.scale_series(results) == [("ns", {"aenv-ns": steps})]
    assert report.render_scale_chart({"meta": results["meta"], "runs": {}}, tmp_path / "none.png") is False
    if report.render_scale_chart(results, tmp_path / "scale.png"):  # only where matplotlib is installed
        assert (tmp_path / "scale.png").stat().st_size > 0

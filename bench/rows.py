"""The one result shape every scenario returns, so the table, the chart, the Results page and the CI smoke
test read all scenarios alike.

A scenario returns ``{"title": str, "rows": [Row, ...], "notes": [str, ...]}``. A row is one metric of
one system (``aenv-ns``, ``aenv-vm``, ``docker``, ``runc``, ``qemu cold boot``) with its sample count
and percentiles. Single-valued metrics (creates/s, sandboxes in 4 GiB) have ``n`` = the number of
samples they were computed from and the value in every percentile field.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

Row = dict[str, Any]
T = TypeVar("T")


def ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def timed(fn: Callable[[], object]) -> float:
    """Milliseconds ``fn`` took."""
    t0 = time.perf_counter()
    fn()
    return ms_since(t0)


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[idx]


def row(metric: str, system: str, samples: list[float], unit: str = "ms", note: str = "") -> Row:
    """A row from raw samples (empty samples give n = 0, which the smoke test rejects)."""
    if not samples:
        return {"metric": metric, "system": system, "unit": unit, "n": 0, "note": note}
    digits = 2 if unit == "ms" else 1
    return {
        "metric": metric, "system": system, "unit": unit, "n": len(samples),
        "p50": round(statistics.median(samples), digits), "p95": round(pct(samples, 95), digits),
        "p99": round(pct(samples, 99), digits), "min": round(min(samples), digits),
        "max": round(max(samples), digits), "note": note,
    }  # fmt: skip


def value_row(metric: str, system: str, value: float, n: int, unit: str, note: str = "") -> Row:
    v = round(value, 1)
    return {"metric": metric, "system": system, "unit": unit, "n": n,
            "p50": v, "p95": v, "p99": v, "min": v, "max": v, "note": note}  # fmt: skip


def scenario(title: str, rows: Iterable[Row], notes: Iterable[str] = ()) -> dict[str, Any]:
    return {"title": title, "rows": list(rows), "notes": [n for n in notes if n]}


def alternate(
    n: int, systems: list[tuple[str, Callable[[], T]]], limits: dict[str, int] | None = None, settle: float = 0.0
) -> dict[str, list[T]]:
    """``n`` rounds; each round samples every system once, the order flipped every other round so drift
    and warm-up effects fall on all systems alike. ``limits`` caps a slow system's samples (it then takes
    part in the first rounds only). ``settle``: seconds after each sample before the next system's, so
    what one system does in the background after a sample (a pool refill, a container's teardown) lands
    on its own next sample's time, not on another system's. Returns samples per system name."""
    out: dict[str, list[T]] = {name: [] for name, _ in systems}
    for i in range(n):
        for name, fn in systems if i % 2 == 0 else list(reversed(systems)):
            if limits is None or len(out[name]) < limits.get(name, n):
                out[name].append(fn())
                if settle:
                    time.sleep(settle)
    return out

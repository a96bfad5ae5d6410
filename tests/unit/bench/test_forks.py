"""The fork scenario's assembly: with ``--against`` the commit before is forked beside this checkout, in
alternating order, and gets rows of its own (the issue's targets are read beside it)."""

from __future__ import annotations

from typing import Any

import pytest

from bench import forks
from bench.previous import PreviousServer


class _Ctx:
    runtime = "ns"
    system = "aenv-ns"
    smoke = False

    def __init__(self, previous: PreviousServer | None) -> None:
        self.previous = previous
        self.client = object()

    def n(self, smoke: int, full: int, vm: int | None = None) -> int:
        return 2

    def heavy_docker(self) -> None:
        return None


def _fake_runs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str | None, int]]:
    calls: list[tuple[str | None, int]] = []

    def scenario_fork(client: Any, counts: list[int], reps: int, url: str | None = None) -> dict[str, Any]:
        (n,) = counts
        calls.append((url, n))
        took = 100.0 * n + (1000 if url else 0)  # the commit before: 1 s slower, to tell its rows apart
        return {f"x{n}": {"all_answering": {"p50_ms": took}, "fork_call": {"p50_ms": took / 2},
                          "mode": "processes" if url is None else "filesystem"}}

    monkeypatch.setattr(forks.snapshots, "scenario_fork", scenario_fork)
    monkeypatch.setattr(forks, "AenvClient", lambda url, key: _NullClient())
    return calls


class _NullClient:
    def __enter__(self) -> _NullClient:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def test_the_commit_before_gets_rows_of_its_own_in_alternating_order(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_runs(monkeypatch)
    prev = PreviousServer(system="aenv-ns@c2f83ca", url="http://127.0.0.1:9")
    out = forks.fork(_Ctx(prev))  # type: ignore[arg-type]
    rows = {(r["metric"], r["system"]): r for r in out["rows"]}
    for n in forks.FORK_COUNTS:
        ours, before = rows[(f"fork ×{n} → all children answer", "aenv-ns")], rows[(
            f"fork ×{n} → all children answer", "aenv-ns@c2f83ca")]
        assert (ours["n"], before["n"]) == (2, 2)
        assert before["p50"] == ours["p50"] + 1000 and before["note"] == "mode filesystem"
        assert rows[(f"fork ×{n}: the fork call", "aenv-ns@c2f83ca")]["p50"] == before["p50"] / 2
    # the first repetition forks this checkout first, the second the commit before first
    first, second = calls[: 2 * len(forks.FORK_COUNTS)], calls[2 * len(forks.FORK_COUNTS):]
    assert first[:2] == [(None, 1), (prev.url, 1)] and second[:2] == [(prev.url, 1), (None, 1)]


def test_without_against_only_this_checkout_is_forked(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_runs(monkeypatch)
    out = forks.fork(_Ctx(None))  # type: ignore[arg-type]
    assert {r["system"] for r in out["rows"]} == {"aenv-ns"}
    assert all(url is None for url, _ in calls)

"""Per-run counters for ``/metrics``: what ``aenv.rl``'s per-rollout ``metrics`` dict says on the client,
the server says per run label, so one dashboard shows every trainer's creates, forks, kills and
refusals without each trainer exporting its own.

The run is the sandbox's value of the admission group key (metadata ``run`` by default, as
``aenv.rl`` tags every sandbox). Counters are kept for the ``MAX_RUNS`` most recently active runs, so
a server that sees a new run every minute for a month does not grow its scrape without bound.

Counters are kept per team and run (two teams may both call their run ``r1``): the scrape sums a run
over its teams, as before; :meth:`RunMetrics.counters` gives one team its own (the console's runs page).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from aenv.store.sqlite import SandboxRow

MAX_RUNS = 500
EVENTS = ("created", "forked", "paused", "resumed", "killed")


def _label(value: str) -> str:
    """A Prometheus label value: backslash, quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class RunMetrics:
    def __init__(self, run_key: str) -> None:
        self.run_key = run_key
        self._events: OrderedDict[tuple[str, str], dict[str, int]] = OrderedDict()  # (team, run) -> counts
        self._refused: OrderedDict[tuple[str, str], dict[str, int]] = OrderedDict()

    def _bump(self, table: OrderedDict[tuple[str, str], dict[str, int]], key: tuple[str, str], what: str) -> None:
        counts = table.setdefault(key, {})
        counts[what] = counts.get(what, 0) + 1
        table.move_to_end(key)
        while len(table) > MAX_RUNS:
            table.popitem(last=False)

    def on_event(self, event: str, row: SandboxRow, extra: dict[str, str]) -> None:
        """An orchestrator event hook (never blocks)."""
        run = row.metadata.get(self.run_key)
        if run is not None and event in EVENTS:
            self._bump(self._events, (row.owner, run), event)

    def on_refused(self, team: str, run: str | None, reason: str) -> None:
        """Admission refused a create of ``team``'s ``run`` (``capacity``, ``quota``)."""
        if run is not None:
            self._bump(self._refused, (team, run), reason)

    def counters(self, team: str | None) -> dict[str, dict[str, dict[str, int]]]:
        """Each run's counters, ``{run: {"events": {...}, "refused": {...}}}``: ``team``'s runs only, or
        every team's summed (None, an admin's view)."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for part, table in (("events", self._events), ("refused", self._refused)):
            for (owner, run), counts in table.items():
                if team is not None and owner != team:
                    continue
                into = out.setdefault(run, {"events": {}, "refused": {}})[part]
                for k, n in counts.items():
                    into[k] = into.get(k, 0) + n
        return out

    def prometheus(self, live: Iterable[SandboxRow]) -> list[str]:
        summed = self.counters(None)
        lines = ["# HELP aenv_run_events_total Sandbox lifecycle events by run label",
                 "# TYPE aenv_run_events_total counter"]  # fmt: skip
        for run, parts in summed.items():
            lines += [f'aenv_run_events_total{{run="{_label(run)}",event="{e}"}} {n}'
                      for e, n in sorted(parts["events"].items())]  # fmt: skip
        lines += ["# HELP aenv_run_creates_refused_total Creates refused by admission, by run label and reason",
                  "# TYPE aenv_run_creates_refused_total counter"]  # fmt: skip
        for run, parts in summed.items():
            lines += [f'aenv_run_creates_refused_total{{run="{_label(run)}",reason="{r}"}} {n}'
                      for r, n in sorted(parts["refused"].items())]  # fmt: skip
        by_run: dict[tuple[str, str], int] = {}
        for row in live:
            tag = row.metadata.get(self.run_key)
            if tag is not None:
                by_run[(tag, row.state)] = by_run.get((tag, row.state), 0) + 1
        lines += ["# HELP aenv_run_sandboxes Live sandboxes by run label and state", "# TYPE aenv_run_sandboxes gauge"]
        lines += [f'aenv_run_sandboxes{{run="{_label(run)}",state="{state}"}} {n}'
                  for (run, state), n in sorted(by_run.items())]  # fmt: skip
        return lines

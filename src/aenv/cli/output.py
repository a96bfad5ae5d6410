"""What the CLI prints, and where: data to stdout, diagnostics and progress to stderr.

Errors take three parts (``error:`` / ``Caused by:`` / ``hint:``) and map to an ExitStatus.
"""

from __future__ import annotations

import enum
import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

from rich.console import Console


class ExitStatus(enum.IntEnum):
    OK = 0
    ERROR = 1
    USAGE = 2
    NOT_FOUND = 3
    UNREACHABLE = 4
    TIMEOUT = 5
    INTERRUPTED = 130


NARROW = 16  # the most a squeezed column of a fitted table takes


class Printer:
    def __init__(self, quiet: bool = False) -> None:
        self.out = Console(file=sys.stdout, highlight=False, soft_wrap=True)
        self.err = Console(file=sys.stderr, highlight=False, soft_wrap=True)
        self.quiet = quiet

    def data(self, text: str) -> None:
        self.out.print(text, markup=False)

    def json(self, obj: Any) -> None:
        sys.stdout.write(json.dumps(obj, indent=2) + "\n")

    def table(self, columns: Sequence[str], rows: Iterable[Sequence[str]], *, whole: Sequence[int] = ()) -> None:
        """A borderless table on stdout (what every ``ls`` prints without ``-o json``). With ``whole``
        the table fits the terminal on one line a row: those columns (IDs) are never shortened, the
        others take at most ``NARROW`` characters and the last one the rest, ending in "…"."""
        from rich.table import Table

        rows = [tuple(r) for r in rows]
        table = Table(box=None, pad_edge=not whole)
        if not whole:
            for col in columns:
                table.add_column(col)
        else:
            natural = [max([len(col), *(len(r[i]) for r in rows)]) for i, col in enumerate(columns)]
            widths = [n if i in whole else min(n, NARROW) for i, n in enumerate(natural)]
            room = self.out.width - sum(widths[:-1]) - 2 * (len(columns) - 1)
            if len(columns) - 1 not in whole:
                widths[-1] = max(min(natural[-1], room), len(columns[-1]))
            for col, width in zip(columns, widths, strict=True):
                table.add_column(col, no_wrap=True, overflow="ellipsis", width=width)
        for row in rows:
            table.add_row(*row)
        self.out.print(table)

    def info(self, text: str) -> None:
        if not self.quiet:
            self.err.print(text)

    def fail(
        self, message: str, *, causes: list[str] | None = None, hint: str | None = None, status: ExitStatus = ExitStatus.ERROR
    ) -> NoReturn:
        self.err.print(f"[bold red]error:[/] {message}", markup=True)
        for cause in causes or []:
            self.err.print(f"  [red]Caused by:[/] {cause}", markup=True)
        if hint:
            self.err.print(f"[bold cyan]hint:[/] {hint}", markup=True)
        raise SystemExit(int(status))

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


class Printer:
    def __init__(self, quiet: bool = False) -> None:
        self.out = Console(file=sys.stdout, highlight=False, soft_wrap=True)
        self.err = Console(file=sys.stderr, highlight=False, soft_wrap=True)
        self.quiet = quiet

    def data(self, text: str) -> None:
        self.out.print(text, markup=False)

    def json(self, obj: Any) -> None:
        sys.stdout.write(json.dumps(obj, indent=2) + "\n")

    def table(self, columns: Sequence[str], rows: Iterable[Sequence[str]]) -> None:
        """A borderless table on stdout (what every ``ls`` prints without ``-o json``)."""
        from rich.table import Table

        table = Table(box=None)
        for col in columns:
            table.add_column(col)
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

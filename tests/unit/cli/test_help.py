"""Every `aenv … --help` renders: help text goes through Rich markup, where a stray `[/x]` crashes it."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from aenv.cli.main import app


def _command_paths() -> list[list[str]]:
    root = typer.main.get_command(app)
    paths: list[list[str]] = [[]]

    def walk(cmd: object, prefix: list[str]) -> None:
        # typer vendors its own click: duck-type groups by their ``commands`` mapping
        for name, sub in (getattr(cmd, "commands", None) or {}).items():
            paths.append([*prefix, name])
            walk(sub, [*prefix, name])

    walk(root, [])
    return paths


@pytest.mark.parametrize("path", _command_paths(), ids=lambda p: " ".join(p) or "aenv")
def test_help_renders(path: list[str]) -> None:
    result = CliRunner().invoke(app, [*path, "--help"])
    assert result.exit_code == 0, result.output
    assert "usage" in result.output.lower()  # `aenv bench` forwards to argparse (lower case)

"""`aenv gateway` refuses a node list it cannot serve, with the flag to fix it, before it binds anything."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from aenv.cli.main import app


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([], "hint: give each node with --node http://HOST:PORT"),
        (["--node", "127.0.0.1:8000"], "give http://HOST:PORT"),
        (["--node", "a=http://h:1", "--node", "a=http://h:2"], "hint: name them: --node NAME=http://HOST:PORT"),
    ],
)
def test_a_bad_node_list_is_a_usage_error(args: list[str], says: str) -> None:
    result = CliRunner().invoke(app, ["gateway", *args], env={"AENV_GATEWAY_NODES": ""})
    assert result.exit_code == 2, result.output
    assert "error:" in result.output and says in " ".join(result.output.split())

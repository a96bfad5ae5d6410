"""``aenv teams``: each team's quota and what it holds on the server (``GET /aenv/teams``), over HTTP only.

A team's key sees its own team; an admin key (``admin_keys``) every team the server knows."""

from __future__ import annotations

from typing import Any, Optional

import typer

from aenv.cli.client import ServerClient
from aenv.cli.output import Printer

ServerOpt = typer.Option(None, "--server", envvar="AENV_SERVER", help="aenv server URL [default: http://127.0.0.1:8000]")
KeyOpt = typer.Option(None, "--api-key", help="API key (else AENV_API_KEY or E2B_API_KEY)")


def _of(used: Any, limit: Any) -> str:
    return f"{used}" if limit is None else f"{used}/{limit:g}"


def teams(
    output: str = typer.Option("table", "--output", "-o", help="table | json"),
    server: Optional[str] = ServerOpt,
    api_key: Optional[str] = KeyOpt,
) -> None:
    """Show each team's sandboxes, vCPUs and memory against its quota, and how often a quota refused it.

    Teams and quotas are the server's settings ('teams', 'team_quota', 'admin_keys': see
    'aenv serve --help'); a key in 'api_keys' and in no team is a team of its own, shown as
    'key-<digest prefix>'."""
    client = ServerClient.from_env(server, api_key, Printer())
    data = client.request("GET", "/aenv/teams").json()
    if output == "json":
        client.printer.json(data)
        return
    client.printer.table(
        ("TEAM", "SANDBOXES", "VCPUS", "MEMORY MB", "CREATES/S", "REFUSED"),
        (
            (t["team"] or "(open server)", _of(t["usage"]["sandboxes"], t["quota"]["max_sandboxes"]),
             _of(t["usage"]["vcpus"], t["quota"]["max_vcpus"]), _of(t["usage"]["memoryMB"], t["quota"]["max_memory_mb"]),
             "-" if t["quota"]["creates_per_second"] is None else f"{t['quota']['creates_per_second']:g}",
             ", ".join(f"{q} {n}" for q, n in sorted(t["refused"].items())) or "-")
            for t in data
        ),
    )  # fmt: skip

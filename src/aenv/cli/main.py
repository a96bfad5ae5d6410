"""The ``aenv`` command: the HTTP commands (``remote.py``, ``build.py``) and this machine's own (``local.py``)."""

from __future__ import annotations

from aenv.cli import build, cluster, compose, gateway, local, teams
from aenv.cli.remote import app, template_app

app.command("build")(build.build)
app.command("teams")(teams.teams)
app.add_typer(compose.compose_app, name="compose")
app.command("gateway", rich_help_panel="Many machines")(gateway.gateway)
app.add_typer(cluster.cluster_app, name="cluster", rich_help_panel="Many machines")
local.register(app, template_app)


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    main()

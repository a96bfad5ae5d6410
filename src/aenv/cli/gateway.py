"""``aenv gateway``: one E2B endpoint in front of several ``aenv serve`` nodes (a static node list)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

from aenv.cli.output import ExitStatus, Printer


def gateway(
    node: Optional[list[str]] = typer.Option(
        None, "--node", "-n", help="a node's URL, http://HOST:PORT or NAME=http://HOST:PORT; repeat per node "
                                   "(AENV_GATEWAY_NODES, comma list) [names default to n1, n2, ...]"),
    host: str = typer.Option("127.0.0.1", help="bind address; anything else without api_keys is loudly warned"),
    port: int = typer.Option(8000, help="port: clients set E2B_API_URL and E2B_SANDBOX_URL to http://HOST:PORT"),
    probe_interval: float = typer.Option(1.0, help="seconds between health and load probes of each node"),
    node_key: Optional[str] = typer.Option(
        None, help="API key the gateway itself sends to nodes (AENV_GATEWAY_NODE_KEY) [default: the first of "
                   "api_keys]"),
    redis: Optional[str] = typer.Option(
        None, help="the cluster directory, redis://HOST:PORT (AENV_GATEWAY_REDIS): nodes and sandbox bindings come "
                   "from it (each node runs aenv serve --cluster-redis); --node then optional"),
    tls_cert: Optional[Path] = typer.Option(
        None, help="serve HTTPS with this PEM certificate (AENV_TLS_CERT; HTTP/2 by ALPN, as aenv serve): give it "
                   "the names the clients use, e.g. api.DOMAIN and *.DOMAIN for E2B_DOMAIN=DOMAIN"),
    tls_key: Optional[Path] = typer.Option(None, help="the PEM private key of --tls-cert (AENV_TLS_KEY)"),
    log_level: str = typer.Option("info", help="debug | info | warning"),
) -> None:  # fmt: skip
    """Serve one E2B endpoint (control plane and sandbox proxy, one port) for several aenv serve nodes.

    Creates go to the least loaded of 3 sampled live nodes (creates in flight counted), fork to the
    source's node, everything about a sandbox to the node that owns it; lists merge every live node, and
    a node that is down is skipped, named in X-Aenv-Nodes-Down. GET /nodes shows each node's state and
    load. With --redis the nodes come from the cluster directory: a node it declares dead takes no creates
    and its sandboxes answer 404 naming it. The nodes must share their templates (build or pull on each). API keys are the server's
    setting (AENV_API_KEYS or api_keys in AENV_CONFIG): the gateway checks them and passes them on, so
    give the nodes the same keys. Example:

        aenv gateway --node http://10.0.0.11:8000 --node http://10.0.0.12:8000 --port 8000
    """
    import logging

    import uvicorn

    from aenv.config import load_settings
    from aenv.gateway import GatewaySettings, create_gateway_app, parse_node

    printer = Printer()
    specs = list(node or []) or [s for s in os.environ.get("AENV_GATEWAY_NODES", "").split(",") if s.strip()]
    redis = redis or os.environ.get("AENV_GATEWAY_REDIS") or None
    if not specs and not redis:
        printer.fail("no nodes", hint="give each node with --node http://HOST:PORT, or the cluster directory with "
                                      "--redis redis://HOST:PORT", status=ExitStatus.USAGE)  # fmt: skip
    try:
        nodes = [parse_node(s.strip(), i) for i, s in enumerate(specs)]
        tls = {k: v for k, v in (("tls_cert", tls_cert), ("tls_key", tls_key)) if v is not None}
        server = load_settings({**tls, "host": host, "port": port, "log_level": log_level})
        keys = server.api_keys
    except Exception as exc:  # a bad URL, pydantic ValidationError, TOML errors
        printer.fail("invalid configuration", causes=[str(exc)], status=ExitStatus.USAGE)
    if len({n.id for n in nodes}) != len(nodes):
        printer.fail("two nodes have the same name", hint="name them: --node NAME=http://HOST:PORT", status=ExitStatus.USAGE)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per relayed request otherwise
    if host not in ("127.0.0.1", "localhost", "::1") and not keys:
        printer.err.print(
            f"[bold yellow]WARNING:[/] binding to {host} with no API keys: anyone who can reach this port can run code "
            "on every node. Set AENV_API_KEYS.", markup=True)  # fmt: skip
    for path in (server.tls_cert, server.tls_key):
        if path is not None and not path.is_file():
            printer.fail(f"no such file: {path}", hint="--tls-cert and --tls-key name PEM files", status=ExitStatus.USAGE)
    settings = GatewaySettings(nodes, keys, node_key or os.environ.get("AENV_GATEWAY_NODE_KEY"), probe_interval, redis,
                               admin_keys=server.admin_keys, teams=server.team_directory())
    if server.tls_cert is not None:
        from aenv.cli.tls_serve import run_tls

        run_tls(create_gateway_app(settings), server)  # hypercorn: HTTP/2 by ALPN, HTTP/1.1 fallback
        return
    uvicorn.run(create_gateway_app(settings), host=host, port=port, log_level=log_level.lower(), access_log=False,
                timeout_keep_alive=75, server_header=False, ws_max_size=settings.ws_max_message)  # fmt: skip

"""``aenv cluster``: aenv on a Ray cluster. ``local`` runs a whole one on this machine; ``controller``,
``status`` and ``stop`` act on a real one (``ray start`` on each host first, see docs/cluster.md)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Optional

import typer

from aenv.cli.output import ExitStatus, Printer

cluster_app = typer.Typer(help="aenv on a Ray cluster: node agents, the controller, a local cluster", no_args_is_help=True)


@cluster_app.command("local")
def local(
    nodes: int = typer.Option(3, "--nodes", "-n", min=1, max=200, help="nodes, each in its own network namespace"),
    port: int = typer.Option(8000, help="the gateway's port on 127.0.0.1"),
    subnet: str = typer.Option("10.213.0.0/24", help="the private /24 of the bridge (.1) and the nodes (.11, .12, ...)"),
    runtime: str = typer.Option("ns", help="the nodes' sandbox runtime: ns | vm | auto"),
    state_dir: Optional[Path] = typer.Option(None, help="where the cluster's state goes [default: /tmp/aenvc<PORT>]; "
                                                        "removed at exit"),
) -> None:  # fmt: skip
    """Start Redis, a Ray head, N nodes (each a Ray node and an aenv serve in its own network namespace),
    the controller and a gateway on 127.0.0.1:PORT; print the gateway URL once every node is up; remove
    everything (processes, namespaces, veths, mounts, state) on Ctrl-C or SIGTERM. Needs root.

    Point the SDKs at it: E2B_API_URL=E2B_SANDBOX_URL=<the printed URL>. API keys (AENV_API_KEYS) and
    other AENV_* settings in this environment are passed to the nodes and the gateway.
    """
    import logging

    from aenv.cluster.local import LocalCluster
    from aenv.cluster.netns import NetnsUnavailable, check_available

    printer = Printer()
    try:
        check_available()
    except NetnsUnavailable as exc:
        printer.fail("cannot make the nodes' network namespaces", causes=[str(exc)], hint="run as root",
                     status=ExitStatus.USAGE)  # fmt: skip
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    env = {k: v for k, v in os.environ.items() if k.startswith("AENV_") and k not in _PER_NODE}
    cluster = LocalCluster(nodes, port, state_dir or Path(f"/tmp/aenvc{port}"), subnet, env, runtime)
    stop = threading.Event()

    def on_signal(signum: int, _: Any) -> None:
        stop.set()
        raise KeyboardInterrupt  # interrupts a start in progress too; close() then runs

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        printer.err.print(f"starting {nodes} nodes on {subnet} (state in {cluster.root}) ...")
        cluster.start()
        print(cluster.url, flush=True)  # stdout: the one line a script reads
        printer.err.print(f"ready: E2B_API_URL={cluster.url} E2B_SANDBOX_URL={cluster.url}; Ctrl-C stops it")
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    except Exception as exc:  # noqa: BLE001 - one clear line; start() already removed what it made
        printer.fail("the cluster did not start", causes=[str(exc)[-2000:]], status=ExitStatus.ERROR)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        printer.err.print("stopping the cluster ...")
        cluster.close()


_PER_NODE = {"AENV_STATE_DIR", "AENV_HOST", "AENV_PORT", "AENV_CLUSTER_REDIS", "AENV_CLUSTER_NODE_ID",
             "AENV_CLUSTER_URL", "AENV_RUNTIME"}  # fmt: skip


@cluster_app.command("controller")
def controller(
    ray_address: str = typer.Option(..., "--ray", help="the Ray head's GCS address, HOST:PORT"),
    redis: str = typer.Option(..., help="the cluster directory, redis://HOST:PORT (every node and gateway uses it)"),
    port: int = typer.Option(8000, help="the port each node's aenv serve listens on"),
    state_dir: str = typer.Option("/var/lib/aenv", help="each node's state directory ({node} is its name)"),
    period: float = typer.Option(1.0, help="seconds between the controller's looks at Ray's node table"),
) -> None:  # fmt: skip
    """Create the controller (a detached Ray actor; a no-op when it runs): it places one node agent on each
    Ray node labelled aenv-node=<name>, which starts or adopts that node's aenv serve on its Ray address,
    and fences nodes Ray declares dead. AENV_* settings here (API keys...) go to every node."""
    from aenv.cluster.agent import ServeSpec

    env = {k: v for k, v in os.environ.items() if k.startswith("AENV_") and k not in _PER_NODE}
    env.update({"AENV_STATE_DIR": state_dir, "AENV_HOST": "{ip}", "AENV_PORT": str(port), "AENV_CLUSTER_REDIS": redis,
                "AENV_CLUSTER_NODE_ID": "{node}", "AENV_CLUSTER_URL": f"http://{{ip}}:{port}"})  # fmt: skip
    run_dir = str(Path(state_dir).parent / "aenv-{node}-run")
    spec = ServeSpec(node="{node}", argv=[sys.executable, "-m", "aenv.cli.main", "serve"], url=f"http://{{ip}}:{port}",
                     pidfile=run_dir + "/serve.pid", log=run_dir + "/serve.log", env=env, redis=redis)  # fmt: skip
    _driver(["start", "--ray", ray_address, "--redis", redis, "--spec", json.dumps(spec.to_dict()),
             "--period", str(period)])  # fmt: skip


@cluster_app.command("status")
def status(ray_address: str = typer.Option(..., "--ray", help="the Ray head's GCS address, HOST:PORT")) -> None:
    """The controller's view: each node, its Ray node id, its agent's answer; nodes fenced; errors."""
    _driver(["status", "--ray", ray_address])


@cluster_app.command("stop")
def stop_cmd(ray_address: str = typer.Option(..., "--ray", help="the Ray head's GCS address, HOST:PORT")) -> None:
    """Kill the controller and every node agent. The nodes' servers and sandboxes keep running."""
    _driver(["stop", "--ray", ray_address])


def _driver(args: list[str]) -> None:
    from aenv.cluster.driver import main

    try:
        import ray  # noqa: F401
    except ImportError:
        Printer().fail("Ray is not installed", hint="pip install 'aenv[cluster]' (or scripts/setup.sh)",
                       status=ExitStatus.USAGE)  # fmt: skip
    raise typer.Exit(main(args))

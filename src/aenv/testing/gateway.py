"""Start and stop a real ``aenv gateway`` process in front of test nodes (tests and bench/)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from aenv.testing.server import Server, free_port, wait_healthy


def start_gateway(tmp: Path, node_urls: list[str], extra_env: dict[str, str] | None = None) -> Server:
    """A gateway on a free port of 127.0.0.1, probing its nodes every 0.2 s; returns once it answers
    ``/health`` (its nodes were probed once by then)."""
    port = free_port()
    log_path = tmp / "gateway.log"
    env = {**os.environ, **(extra_env or {})}
    argv = [sys.executable, "-m", "aenv.cli.main", "gateway", "--port", str(port), "--probe-interval", "0.2"]
    for url in node_urls:
        argv += ["--node", url]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    gw = Server(f"http://127.0.0.1:{port}", tmp, proc, log_path, env)
    if wait_healthy(gw, 60, "aenv gateway"):
        return gw
    stop_gateway(gw)
    raise RuntimeError(f"aenv gateway did not become healthy:\n{gw.log_tail()}")


def stop_gateway(gw: Server) -> None:
    if gw.proc.poll() is None:
        gw.proc.terminate()
        try:
            gw.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            gw.proc.kill()
            gw.proc.wait(timeout=10)

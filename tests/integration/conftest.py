"""Integration fixtures: a real ``aenv serve`` process on a random port, driven by the real e2b SDK.

The runtime under test comes from ``AENV_TEST_RUNTIME`` (``ns`` by default; ``vm`` for the microVM suite).
State lives in a temp dir; the cache (tools bundle, base rootfs) is the machine's shared one, which
``scripts/setup.sh`` prepares. The server fixture owns its process and reaps it, orphans included.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
API_KEY = "e2b_" + "0" * 40


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str
    state_dir: Path
    proc: subprocess.Popen[bytes]
    log_path: Path
    env: dict[str, str]

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def _needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("the ns and vm runtimes need root")


def start_server(tmp: Path, runtime: str, extra_env: dict[str, str] | None = None, port: int | None = None) -> Server:
    port = port or free_port()
    state = tmp / "state"
    log_path = tmp / "server.log"
    env = {
        **os.environ,
        "AENV_STATE_DIR": str(state),
        "AENV_RUNTIME": runtime,
        "AENV_PORT": str(port),
        "AENV_POOL_SIZE": os.environ.get("AENV_TEST_POOL_SIZE", "2"),
        "AENV_LOG_LEVEL": "info",
        **(extra_env or {}),
    }
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "aenv.cli.main", "serve"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = Server(f"http://127.0.0.1:{port}", state, proc, log_path, env)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"aenv serve exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(server.url + "/health", timeout=1, trust_env=False).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    stop_server(server)
    raise RuntimeError(f"aenv serve did not become healthy:\n{server.log_tail()}")


def stop_server(server: Server, sig: int = signal.SIGTERM) -> None:
    if server.proc.poll() is None:
        try:
            os.killpg(server.proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            server.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait(timeout=10)


@pytest.fixture(scope="session")
def runtime_name() -> str:
    return os.environ.get("AENV_TEST_RUNTIME", "ns")


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, runtime_name: str) -> Iterator[Server]:
    _needs_root()
    srv = start_server(tmp_path_factory.mktemp("aenv-server"), runtime_name)
    yield srv
    # Kill what the session left, then stop the server so it cleans up its runtime.
    try:
        for s in httpx.get(srv.url + "/v2/sandboxes", headers={"X-API-KEY": API_KEY}, trust_env=False).json():
            httpx.delete(f"{srv.url}/sandboxes/{s['sandboxID']}", headers={"X-API-KEY": API_KEY}, trust_env=False)
    except Exception:
        pass
    stop_server(srv)


@pytest.fixture(scope="session")
def e2b_env(server: Server) -> Iterator[dict[str, str]]:
    """Point the unmodified SDK at the server, exactly as a user would (spec §1.5)."""
    values = {
        "E2B_API_URL": server.url,
        "E2B_SANDBOX_URL": server.url,
        "E2B_API_KEY": API_KEY,
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        os.environ.pop(k, None)
    yield values
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def sandbox(e2b_env: dict[str, str]) -> Iterator[object]:
    from e2b import Sandbox

    sbx = Sandbox.create("base", timeout=300)
    yield sbx
    try:
        sbx.kill()
    except Exception:
        pass

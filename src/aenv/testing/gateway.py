"""Start and stop a real ``aenv gateway`` process in front of test nodes (tests and bench/), and the\nnodes themselves (``NodeCluster``)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from aenv.cluster.procs import stop_process
from aenv.testing.procs import exit_with_parent
from aenv.testing.server import (
    API_KEY,
    KEEP_SANDBOXES,
    Server,
    Tls,
    discard_lazy_state,
    discard_vm_state,
    free_port,
    healthy_or_stopped,
    start_server,
    stop_server,
)

KEY = {"X-API-KEY": API_KEY}


class NodeCluster:
    """``count`` nodes on free ports of 127.0.0.1, each with its own state dir under ``tmp``, and the
    gateway a test starts in front of them (``gateway``). The runtime is ``runtime``, else
    ``AENV_TEST_RUNTIME`` (ns by default): a cluster test can be run on vm by hand."""

    def __init__(self, tmp: Path, count: int, node_env: dict[str, str], runtime: str | None = None) -> None:
        self.runtime = runtime or os.environ.get("AENV_TEST_RUNTIME", "ns")
        self.tmp = tmp
        self.node_env = node_env
        self.ports = [free_port() for _ in range(count)]
        self.nodes: list[Server | None] = [None] * count
        self.gateway: Server | None = None

    def env_of(self, i: int) -> dict[str, str]:
        return self.node_env

    def start_node(self, i: int) -> Server:
        d = self.tmp / f"n{i + 1}"
        d.mkdir(exist_ok=True)
        # a node's sandboxes outlive its graceful stop, as in production (tests restart nodes on purpose);
        # close() kills them through each node first
        node = start_server(d, self.runtime, {**KEEP_SANDBOXES, **self.env_of(i)}, port=self.ports[i])
        self.nodes[i] = node
        return node

    @property
    def gw(self) -> str:
        assert self.gateway is not None
        return self.gateway.url

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.ports[i]}"

    def ids_on(self, i: int) -> set[str]:
        """The sandboxes node ``i`` itself lists."""
        return {s["sandboxID"] for s in httpx.get(self.url(i) + "/v2/sandboxes", headers=KEY, trust_env=False).json()}

    def close(self) -> None:
        """The gateway, then each node with its sandboxes killed first (a node a test killed is started
        again: it adopts what it left running, so that it can kill it)."""
        if self.gateway is not None:
            stop_gateway(self.gateway)
        for i, node in enumerate(self.nodes):
            if node is None:
                continue
            if node.proc.poll() is not None:
                stop_server(node)
                node = self.start_node(i)
            for sid in self.ids_on(i):
                httpx.delete(f"{self.url(i)}/sandboxes/{sid}", headers=KEY, trust_env=False)
            stop_server(node)
            discard_lazy_state(node.state_dir)  # cluster mode turns lazy images on: aenv-lazyd and its mounts
            if self.runtime == "vm":
                discard_vm_state(node.state_dir)  # QEMUs a killed node left, its template RAM in /dev/shm


@contextlib.contextmanager
def sdk_env(url: str) -> Iterator[None]:
    """The E2B SDKs pointed at ``url`` alone (API, sandbox and volume content traffic) for the block's duration."""
    names = ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_VOLUME_API_URL", "E2B_API_KEY", "NO_PROXY")
    saved = {k: os.environ.get(k) for k in names}
    os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_VOLUME_API_URL=url, E2B_API_KEY=API_KEY,
                      NO_PROXY="127.0.0.1,localhost")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def serving(srv: Server) -> Iterator[Server]:
    """A test's own server with the SDKs pointed at it; stopped, its VM state discarded, when the block ends."""
    try:
        with sdk_env(srv.url):
            yield srv
    finally:
        stop_server(srv)
        discard_vm_state(srv.state_dir)


def wait_for(cond: Callable[[], bool], timeout: float = 60.0) -> None:
    """Poll ``cond`` every 0.1 s until it holds; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def start_gateway(
    tmp: Path, node_urls: list[str], extra_env: dict[str, str] | None = None, port: int | None = None,
    tls: Tls | None = None,
) -> Server:  # fmt: skip
    """A gateway on a free port of 127.0.0.1 (HTTPS with ``tls``), probing its nodes every 0.2 s; returns
    once it answers ``/health`` (its nodes were probed once by then)."""
    port = port or free_port()
    log_path = tmp / "gateway.log"
    env = {**os.environ, **(extra_env or {})}
    argv = [sys.executable, "-m", "aenv.cli.main", "gateway", "--port", str(port), "--probe-interval", "0.2"]
    for url in node_urls:
        argv += ["--node", url]
    if tls is not None:
        argv += ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key)]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=exit_with_parent())  # fmt: skip
    gw = Server(f"{'https' if tls else 'http'}://127.0.0.1:{port}", tmp, proc, log_path, env, tls.ca if tls else None)
    return healthy_or_stopped(gw, 60, "aenv gateway", stop_gateway)


def stop_gateway(gw: Server) -> None:
    stop_process(gw.proc)


"""Integration fixtures: a real ``aenv serve`` process on a random port, driven by the real e2b SDK.

The runtime under test comes from ``AENV_TEST_RUNTIME`` (``ns`` by default; ``vm`` for the microVM suite).
State lives in a temp dir; the cache (tools bundle, base rootfs) is the machine's shared one, which
``scripts/setup.sh`` prepares. The server fixture owns its process and reaps it, orphans included.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.testing.server import API_KEY, Server, discard_vm_state, kill_sandboxes, start_server, stop_server
from tests.fixtures.plugin import PushedImages

__all__ = ["API_KEY", "Server", "start_server", "stop_server"]

REPO = Path(__file__).resolve().parents[2]


def _needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("the ns and vm runtimes need root")


@pytest.fixture(scope="session")
def runtime_name() -> str:
    return os.environ.get("AENV_TEST_RUNTIME", "ns")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that drive a server (the SDK suite) are marked ``sdk``: CI runs them a second time
    with ``AENV_TEST_RUNTIME=vm`` (``scripts/setup.sh test``)."""
    for item in items:
        if {"server", "mirror_server", "lazy_server"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.sdk)


def _needs_runtime(runtime_name: str) -> None:
    _needs_root()
    if runtime_name == "vm":
        from aenv.config import Settings
        from aenv.runtime.vm.runtime import unavailable_reason

        if (why := unavailable_reason(Settings())) is not None:
            pytest.skip(f"vm runtime unavailable: {why}")


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, runtime_name: str) -> Iterator[Server]:
    _needs_runtime(runtime_name)
    if os.environ.get("AENV_TEST_GATEWAY"):  # AENV_TEST_GATEWAY=N: the SDK tests through a gateway, N nodes
        yield from _gateway_in_front(tmp_path_factory, runtime_name, int(os.environ["AENV_TEST_GATEWAY"]))
        return
    if os.environ.get("AENV_TEST_CLUSTER"):  # AENV_TEST_CLUSTER=N: through `aenv cluster local --nodes N`
        yield from _cluster_in_front(runtime_name, int(os.environ["AENV_TEST_CLUSTER"]))
        return
    srv = start_server(tmp_path_factory.mktemp("aenv-server"), runtime_name)
    yield srv
    # Kill what the session left, then stop the server so it cleans up its runtime.
    kill_sandboxes(srv)
    stop_server(srv)
    discard_vm_state(srv.state_dir)  # QEMUs a killed server left, and the template RAM in /dev/shm


def _gateway_in_front(tmp_path_factory: pytest.TempPathFactory, runtime_name: str, n: int) -> Iterator[Server]:
    from aenv.testing.gateway import start_gateway, stop_gateway

    nodes: list[Server] = []
    gw: Server | None = None
    try:
        for _ in range(n):
            nodes.append(start_server(tmp_path_factory.mktemp("aenv-node"), runtime_name))
        gw = start_gateway(tmp_path_factory.mktemp("aenv-gateway"), [node.url for node in nodes])
        gw.node_state_dirs = {f"n{i + 1}": node.state_dir for i, node in enumerate(nodes)}
        yield gw
    finally:
        if gw is not None:
            stop_gateway(gw)
        for node in nodes:
            kill_sandboxes(node)
            stop_server(node)
            discard_vm_state(node.state_dir)


def _cluster_in_front(runtime_name: str, n: int) -> Iterator[Server]:
    """A whole local cluster (Redis, Ray, n nodes in network namespaces): the server is its gateway."""
    from aenv.cluster.local import LocalCluster
    from aenv.testing.server import free_port

    port = free_port()
    c = LocalCluster(n, port, Path(f"/tmp/aenvc{port}"), "10.213.12.0/24", {}, runtime_name)
    try:
        c.start()
        assert c.gateway is not None
        print(f"\nSDK tests through aenv cluster local ({n} nodes): {c.url}", flush=True)
        nodes = {c.topo.name(i): c.root / c.topo.name(i) / "state" for i in range(n)}
        yield Server(c.url, c.root, c.gateway, c.root / "gateway.log", dict(os.environ), node_state_dirs=nodes)
    finally:
        c.close()


@pytest.fixture(scope="module")
def mirror_server(
    tmp_path_factory: pytest.TempPathFactory, pushed_images: PushedImages, runtime_name: str
) -> Iterator[Server]:
    """A server of its own whose ``docker.io`` is the session's local registry (``FROM debian:bookworm``
    and ``from_image`` resolve offline), with no pool: its tests build templates, they do not race creates."""
    _needs_runtime(runtime_name)
    srv = start_server(
        tmp_path_factory.mktemp("mirror-server"), runtime_name,
        {"AENV_REGISTRY_MIRRORS": f"docker.io={pushed_images.registry.url}", "AENV_POOL_SIZE": "0"},
    )  # fmt: skip
    yield srv
    stop_server(srv)
    discard_vm_state(srv.state_dir)


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

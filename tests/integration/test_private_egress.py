"""The operator's allowlist (``private_egress``) and package mirrors (``package_mirrors``) through real
clients against a real server: the unmodified E2B SDK, verifiers' ``E2BRuntime.prepare_execution``
routing a sandbox's model calls to an interception server on an allowed private address and on an
exposed host port, and smolagents' ``E2BExecutor`` installing a tool's requirement from a package index
on an allowed address. Private hosts live in a network namespace the test makes
(tests/fixtures/privatehosts.py); nothing leaves the machine.

The check that matters most: with one allowed endpoint, exactly that address and port is reachable and
nothing beside it (other ports of the same host, the named-only host, the host's own addresses, other
host ports, the aenv API); a default server refuses all of them. Marked ``sdk``: it runs on vm too
(AENV_TEST_RUNTIME=vm)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from aenv.runtime.allowlist import HOST_SERVICES
from aenv.testing.gateway import serving
from aenv.testing.server import API_KEY, Server, start_server
from tests.fixtures.interpreter import register_interpreter
from tests.fixtures.privatehosts import (
    INDEX,
    MODEL,
    OTHER_PORT,
    PORT,
    TOOL,
    TOOL_VALUE,
    PrivateHosts,
    host_addresses,
    private_hosts,
)

pytestmark = pytest.mark.sdk

APT_MIRROR = f"http://{INDEX}:{PORT}/debian"  # written into sandboxes, not served (apt is not run here)
NPM_MIRROR = f"http://{INDEX}:{PORT}/npm/"  # likewise: npm (code-interpreter-v1 has Node) is asked its registry

# The sandbox's side: connect to each ADDR:PORT, send an HTTP request, print what came back per target.
_PROBE = r"""
import json, socket, sys
out = {}
for target in sys.argv[2:]:
    addr, port = target.rsplit(":", 1)
    try:
        s = socket.create_connection((addr, int(port)), timeout=5)
        s.sendall(f"GET {sys.argv[1]} HTTP/1.0\r\nHost: {addr}\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        out[target] = data.decode(errors="replace").split("\r\n\r\n", 1)[-1][:300] or "reached, empty"
    except OSError as exc:
        out[target] = f"failed {type(exc).__name__}"
print(json.dumps(out))
"""


def _skip_unless_runtime(runtime_name: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces, the ns runtime)")
    if runtime_name == "vm":
        from aenv.config import Settings
        from aenv.runtime.vm.runtime import unavailable_reason

        if (why := unavailable_reason(Settings())) is not None:
            pytest.skip(f"vm runtime unavailable: {why}")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory, runtime_name: str) -> Iterator[PrivateHosts]:
    _skip_unless_runtime(runtime_name)
    with private_hosts(tmp_path_factory.mktemp("private-index")) as h:
        yield h


def _env(h: PrivateHosts) -> dict[str, str]:
    return {"AENV_PRIVATE_EGRESS": f"{INDEX}:{PORT},named:{MODEL}:{PORT},localhost:{h.host_port}",
            "AENV_PACKAGE_MIRRORS": f"pip={h.index_url},apt={APT_MIRROR},npm={NPM_MIRROR}"}


@pytest.fixture(scope="module")
def allow_server(tmp_path_factory: pytest.TempPathFactory, runtime_name: str, hosts: PrivateHosts) -> Iterator[Server]:
    with serving(start_server(tmp_path_factory.mktemp("aenv-allow"), runtime_name, extra_env=_env(hosts))) as srv:
        yield srv


def _probe(sbx: Sandbox, targets: list[str], path: str = "/probe") -> dict[str, str]:
    sbx.files.write("/tmp/probe.py", _PROBE)
    out = sbx.commands.run(f"python3 /tmp/probe.py {path} {' '.join(targets)}", timeout=120).stdout
    return dict(json.loads(out))


def _reached(results: dict[str, str]) -> set[str]:
    return {t for t, v in results.items() if not v.startswith("failed")}


def _port(srv: Server) -> int:
    return int(srv.url.rsplit(":", 1)[1])


def _everything(h: PrivateHosts, api_port: int) -> list[str]:
    """Every endpoint a test asks about: the allowed ones and everything beside them."""
    host_side = [f"{a}:{p}" for a in host_addresses() for p in (h.hidden_port, api_port, h.host_port)]
    return [f"{INDEX}:{PORT}", f"{INDEX}:{OTHER_PORT}", f"{MODEL}:{PORT}", f"{MODEL}:{OTHER_PORT}",
            f"{HOST_SERVICES}:{h.host_port}", f"{HOST_SERVICES}:{h.hidden_port}", f"{HOST_SERVICES}:{api_port}",
            *host_side]


def test_exactly_the_allowed_endpoints_are_reachable(allow_server: Server, hosts: PrivateHosts) -> None:
    sbx = Sandbox.create("base", timeout=300)
    try:
        results = _probe(sbx, _everything(hosts, _port(allow_server)))
        assert _reached(results) == {f"{INDEX}:{PORT}", f"{HOST_SERVICES}:{hosts.host_port}"}, results
        assert results[f"{HOST_SERVICES}:{hosts.host_port}"] == f"answer addr=127.0.0.1 port={hosts.host_port} path=/probe"
        assert TOOL in results[f"{INDEX}:{PORT}"] or "404" in results[f"{INDEX}:{PORT}"]
    finally:
        sbx.kill()


def test_named_entries_open_only_for_the_sandbox_that_names_them(allow_server: Server, hosts: PrivateHosts) -> None:
    sbx = Sandbox.create("base", timeout=300, network={"allow_out": [MODEL]})
    try:
        results = _probe(sbx, _everything(hosts, _port(allow_server)))
        assert _reached(results) == {f"{INDEX}:{PORT}", f"{MODEL}:{PORT}", f"{HOST_SERVICES}:{hosts.host_port}"}
        assert results[f"{MODEL}:{PORT}"] == f"answer addr={MODEL} port={PORT} path=/probe"
    finally:
        sbx.kill()
    with pytest.raises(Exception, match="private_egress") as err:  # an address no entry covers
        Sandbox.create("base", timeout=60, network={"allow_out": ["10.231.41.9"]})
    assert "network.allowOut" in str(err.value)


def test_info_and_doctor_show_the_allowlist(allow_server: Server, hosts: PrivateHosts) -> None:
    info = httpx.get(f"{allow_server.url}/aenv/info", headers={"X-API-KEY": API_KEY}, timeout=30).json()
    shown = {(e["reach"], e["sandboxes"]) for e in info["network"]["privateEgress"]}
    assert shown == {(f"{INDEX}:{PORT}", "all"), (f"{MODEL}:{PORT}", "named in allowOut"),
                     (f"{HOST_SERVICES}:{hosts.host_port}", "all")}
    assert info["network"]["packageMirrors"] == {"pip": hosts.index_url, "apt": APT_MIRROR, "npm": NPM_MIRROR}
    env = {**os.environ, **_env(hosts), "AENV_STATE_DIR": str(allow_server.state_dir)}
    out = subprocess.run([sys.executable, "-m", "aenv.cli.main", "doctor", "-o", "json"], env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    doctor = json.loads(out)
    assert f"named:{MODEL}:{PORT} → {MODEL}:{PORT} (named in allowOut)" in doctor["private egress"]
    assert hosts.index_url in doctor["package mirrors"]


def test_pip_installs_from_the_operators_mirror_in_the_base_template_and_apt_is_pointed_there(allow_server: Server, hosts: PrivateHosts) -> None:
    sbx = Sandbox.create("base", timeout=300)
    try:
        result = sbx.commands.run(f"python3 -m pip install --no-cache-dir {TOOL} && "
                                  "python3 -c 'import aenv_probe_tool as t; print(t.VALUE)'", timeout=300)
        assert result.stdout.strip().endswith(TOOL_VALUE), result
        assert sbx.files.read("/etc/apt/sources.list.d/aenv-mirror.list") == f"deb {APT_MIRROR} bookworm main\n"
    finally:
        sbx.kill()


# verifiers' E2B runtime in its own venv (tests/fixtures/tool_venv.py): the sandbox its start() would make,
# without its template build (that pulls an image), then prepare_execution with each route read from stdin.
VERIFIERS_DRIVER = """
import asyncio, sys
from e2b import AsyncSandbox
from verifiers.v1.runtimes.e2b import E2BConfig, E2BRuntime

async def main():
    runtime = E2BRuntime(E2BConfig(allow=[]))  # framework routes only: what a locked-down rollout gets
    runtime._sandbox = await AsyncSandbox.create("base", timeout=300)
    try:
        print(runtime._sandbox.sandbox_id, flush=True)
        for line in sys.stdin:
            await runtime.prepare_execution([line.strip()])
            print("routed", flush=True)
    finally:
        await runtime._sandbox.kill()

asyncio.run(main())
"""


def test_verifiers_routes_model_calls_to_an_allowed_address_and_a_host_port(
        allow_server: Server, hosts: PrivateHosts) -> None:
    from tests.fixtures.tool_venv import tool_python

    python = tool_python("verifiers", "import verifiers.v1.runtimes.e2b, e2b", "verifiers[e2b]")
    with subprocess.Popen([str(python), "-c", VERIFIERS_DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True, env=dict(os.environ)) as driver:
        assert driver.stdin is not None and driver.stdout is not None
        stdin, stdout = driver.stdin, driver.stdout

        def route(url: str) -> None:
            stdin.write(url + "\n")
            stdin.flush()
            assert stdout.readline().strip() == "routed", f"verifiers' prepare_execution({url!r}) failed"

        try:
            sbx = Sandbox.connect(stdout.readline().strip())
            route(f"http://{MODEL}:{PORT}/v1")
            results = _probe(sbx, _everything(hosts, _port(allow_server)), "/v1/chat/completions")
            assert _reached(results) == {f"{MODEL}:{PORT}"}, results  # deny-all: the named route alone
            assert results[f"{MODEL}:{PORT}"] == f"answer addr={MODEL} port={PORT} path=/v1/chat/completions"

            route(f"http://{HOST_SERVICES}:{hosts.host_port}/v1")
            results = _probe(sbx, _everything(hosts, _port(allow_server)), "/v1/chat/completions")
            assert _reached(results) == {f"{HOST_SERVICES}:{hosts.host_port}"}, results
        finally:
            stdin.close()  # the driver kills its sandbox and ends
            driver.wait(timeout=120)


def test_smolagents_installs_a_tools_requirement_from_the_private_index(
        allow_server: Server, hosts: PrivateHosts) -> None:
    pytest.importorskip("smolagents.remote_executors", reason="smolagents is in the test extra: pip install -e '.[test]'")
    register_interpreter(allow_server)  # the template smolagents' E2BExecutor asks for
    from smolagents.monitoring import AgentLogger, LogLevel
    from smolagents.remote_executors import E2BExecutor

    executor = E2BExecutor(additional_imports=[TOOL], logger=AgentLogger(level=LogLevel.OFF), timeout=600)
    try:
        out = executor.run_code_raise_errors("import aenv_probe_tool\nprint(aenv_probe_tool.VALUE)")
        assert TOOL_VALUE in out.logs
        # the template has Node, so npm too, pointed at the operator's registry
        npm = executor.sandbox.commands.run("npm config get registry && npm --version", timeout=120).stdout.split()
        assert npm[0] == NPM_MIRROR and npm[1].startswith("10."), npm
    finally:
        executor.sandbox.kill()


def test_a_default_server_refuses_private_ranges_and_the_host(
        tmp_path_factory: pytest.TempPathFactory, runtime_name: str, hosts: PrivateHosts) -> None:
    with serving(start_server(tmp_path_factory.mktemp("aenv-default"), runtime_name)) as srv:
        sbx = Sandbox.create("base", timeout=300)
        try:
            assert _reached(_probe(sbx, _everything(hosts, _port(srv)))) == set()
        finally:
            sbx.kill()
        with pytest.raises(Exception, match="not allowed"):
            Sandbox.create("base", timeout=60, network={"allow_out": [INDEX]})


def test_tool_wheel_is_a_real_wheel(tmp_path: Path) -> None:
    """The index's wheel installs with the host's pip too (so a failure above is the sandbox's)."""
    from tests.fixtures.privatehosts import make_wheel

    wheel = make_wheel(tmp_path / "idx")
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                    str(target), str(wheel)], check=True, timeout=120)
    assert (target / "aenv_probe_tool.py").read_text().strip() == f"VALUE = {TOOL_VALUE!r}"

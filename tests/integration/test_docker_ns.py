"""Docker inside an ns sandbox (the ``docker`` template, issue 40), through the unmodified E2B SDK: dockerd
runs in the sandbox's own user namespace (rootless, its cgroups the sandbox's), pulls a Docker Hub name
through the operator's Docker mirror (``package_mirrors``: the session's local registry, reached through the
allowlist), builds a
two-step Dockerfile, runs two containers that find each other by name on a user network, and publishes
a port the sandbox proxy reaches. Its root, with every capability of its own user namespace, still cannot
open the egress filter (the router's). A node that does not allow it answers a 400 naming the setting,
and a fork or snapshot of such a sandbox a 409 saying why (CRIU cannot dump it on ns).

ns only: the vm runtime's Docker inside is ``test_docker_vm.py``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from aenv.runtime.allowlist import HOST_SERVICES
from aenv.testing.server import API_KEY, Server, start_server, stop_server
from tests.fixtures.docker import docker_env, register_docker
from tests.fixtures.plugin import PushedImages

PAGE = "served-from-a-nested-container"


@pytest.fixture(scope="module")
def docker_server(tmp_path_factory: pytest.TempPathFactory, pushed_images: PushedImages,
                  runtime_name: str) -> Iterator[Server]:
    if runtime_name != "ns":
        pytest.skip("Docker inside an ns sandbox (the vm runtime's: test_docker_vm.py)")
    if "busybox" in pushed_images.skipped:
        pytest.skip(f"no busybox fixture image: {pushed_images.skipped['busybox']}")
    port = int(pushed_images.registry.host.rsplit(":", 1)[1])
    srv = start_server(tmp_path_factory.mktemp("docker-ns"), "ns", {
        **docker_env(port), "AENV_POOL_SIZE": "0", "AENV_PACKAGE_MIRRORS": f"docker=http://{HOST_SERVICES}:{port}"})
    try:
        register_docker(srv)
        yield srv
    finally:
        stop_server(srv)


def _sdk(server: Server) -> dict[str, Any]:
    return {"api_key": API_KEY, "api_url": server.url, "sandbox_url": server.url}


@pytest.fixture(scope="module")
def sbx(docker_server: Server) -> Iterator[Any]:
    from e2b import Sandbox

    sandbox = Sandbox.create("docker", timeout=600, **_sdk(docker_server))  # the mirror in its daemon.json
    yield sandbox
    with contextlib.suppress(Exception):
        sandbox.kill()


def _root(sandbox: Any, cmd: str, timeout: float = 180) -> str:
    return str(sandbox.commands.run(cmd, user="root", timeout=timeout).stdout)


def test_docker_run_pulls_a_docker_hub_name_through_the_mirror(sbx: Any) -> None:
    out = _root(sbx, "docker run --rm busybox:latest echo hello-from-nested; docker info --format '{{.Driver}}'")
    assert out.split() == ["hello-from-nested", "overlay2"]
    assert "busybox" in _root(sbx, "docker images --format '{{.Repository}}'")


def test_the_default_user_runs_docker_without_sudo(sbx: Any) -> None:
    assert sbx.commands.run("id -nG; docker ps -q | wc -l", timeout=60).stdout.split()[-1].isdigit()
    assert "docker" in sbx.commands.run("id -nG", timeout=60).stdout.split()


def test_docker_build_of_a_two_step_dockerfile(sbx: Any) -> None:
    sbx.files.write("/root/ctx/Dockerfile",
                    "FROM busybox:latest\nRUN echo step-one > /one\nRUN cat /one /one > /two\nCMD [\"cat\", \"/two\"]\n")
    _root(sbx, "docker build -q -t aenv-test/two-step /root/ctx")
    assert _root(sbx, "docker run --rm aenv-test/two-step").split() == ["step-one", "step-one"]


def test_containers_find_each_other_and_a_published_port_is_reachable(sbx: Any, docker_server: Server) -> None:
    sbx.files.write("/root/www/index.html", PAGE + "\n")
    _root(sbx, "docker network create web-net >/dev/null && docker run -d --name web --network web-net "
               "-v /root/www:/www:ro -p 8080:80 busybox:latest httpd -f -p 80 -h /www >/dev/null")
    # by name through Docker's embedded DNS server of the user network (busybox-static's wget crashes
    # in static glibc's service lookup, so plain HTTP over nc)
    by_name = _root(sbx, "docker run --rm --network web-net busybox:latest sh -c 'for i in $(seq 50); do "
                         "ip=$(busybox nslookup web | sed -n \"s/^Address: *//p\" | tail -1); [ -n \"$ip\" ] && "
                         "printf \"GET / HTTP/1.0\\r\\n\\r\\n\" | busybox nc -w 5 $ip 80 | tail -1 | grep . && break; "
                         "sleep 0.2; done'")
    assert by_name.strip() == PAGE
    # the sandbox's own port 8080 (docker-proxy), through the sandbox proxy as get_host(8080) is
    got = httpx.get(docker_server.url, headers={"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8080"},
                    timeout=60)
    assert got.status_code == 200 and got.text.strip() == PAGE


def test_fork_and_snapshot_answer_409_naming_why(sbx: Any, docker_server: Server) -> None:
    headers = {"X-API-Key": API_KEY}
    for path, body in ((f"/sandboxes/{sbx.sandbox_id}/fork", {"count": 1}),
                       (f"/sandboxes/{sbx.sandbox_id}/snapshots", {})):
        r = httpx.post(docker_server.url + path, json=body, headers=headers, timeout=120)
        assert r.status_code == 409, (path, r.text)
        assert "Docker inside" in r.json()["message"], r.text
    assert _root(sbx, "docker ps --format '{{.Names}}'").split() == ["web"]  # it runs on, untouched


def test_its_root_sees_its_own_cgroups_and_cannot_raise_their_limits(sbx: Any) -> None:
    """The cgroup hierarchies runc wants are mounted in a cgroup namespace rooted at the sandbox's cgroups;
    their files stay the host's, so every capability of its user namespace does not lift its limits."""
    out = _root(sbx, "cat /proc/self/cgroup | grep memory; "
                     "echo 109951162777600 > /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null "
                     "&& echo raised || echo refused; "
                     "cat /proc/sys/vm/swappiness > /proc/sys/vm/swappiness 2>/dev/null && echo sysctl "
                     "|| echo kernel-sysctls-closed")
    assert out.split() == [out.split()[0], "refused", "kernel-sysctls-closed"], out
    assert out.split()[0].endswith(":memory:/"), out  # the namespace's root is the sandbox's own cgroup


def test_pause_and_resume_keep_the_containers_running(sbx: Any, docker_server: Server) -> None:
    """ns pauses by freezing the sandbox's cgroup (dockerd, containerd and the containers with it); a
    nested sandbox is never released to disk (CRIU cannot dump it), so it resumes as it was."""
    from e2b import Sandbox

    _root(sbx, "docker run -d --name sleeper busybox:latest sleep 100000 >/dev/null")
    assert sbx.pause()
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=600, **_sdk(docker_server))
    assert "sleeper" in _root(resumed, "docker ps --format '{{.Names}}'").split()
    assert _root(resumed, "docker exec sleeper echo still-here").strip() == "still-here"


def test_a_node_that_does_not_allow_it_answers_400_naming_the_setting(
        docker_server: Server, tmp_path_factory: pytest.TempPathFactory) -> None:
    from e2b import Sandbox, SandboxException

    srv = start_server(tmp_path_factory.mktemp("docker-off"), "ns",
                       {"AENV_NS_NESTED_CONTAINERS": "0", "AENV_POOL_SIZE": "0"})
    try:
        register_docker(srv)
        with pytest.raises(SandboxException, match="ns_nested_containers") as err:
            Sandbox.create("docker", timeout=60, **_sdk(srv))
        assert "400" in str(err.value)
    finally:
        stop_server(srv)


def test_its_root_cannot_open_the_egress_filter(docker_server: Server, pushed_images: PushedImages) -> None:
    """The filter is the router's (``nested.behind_router``), out of reach of the sandbox's user namespace:
    with every firewall rule it can see flushed, the host's services stay closed but for the allowlist's
    port, from the sandbox and from its containers alike."""
    from e2b import Sandbox

    allowed = int(pushed_images.registry.host.rsplit(":", 1)[1])
    closed = int(docker_server.url.rsplit(":", 1)[1])  # aenv's own API port: never opened to sandboxes
    sandbox = Sandbox.create("docker", timeout=300, **_sdk(docker_server))
    try:
        nc = "printf \"GET /v2/ HTTP/1.0\\r\\n\\r\\n\" | busybox nc -w 5 10.0.2.2 PORT | head -1 | grep -c 200 || true"
        inside = _root(sandbox, f"docker run --rm busybox:latest sh -c '{nc.replace('PORT', str(allowed))}; "
                                f"{nc.replace('PORT', str(closed))}'")
        assert inside.split() == ["1", "0"], inside
        probe = "curl -s -m 5 -o /dev/null -w '%{http_code} ' http://10.0.2.2:PORT/v2/"
        out = _root(sandbox, "iptables -F; iptables -t nat -F; iptables-legacy -F; iptables-legacy -t nat -F; "
                             f"{probe.replace('PORT', str(allowed))}; {probe.replace('PORT', str(closed))}; true")
        assert out.split() == ["200", "000"], out
    finally:
        with contextlib.suppress(Exception):
            sandbox.kill()


def test_a_killed_servers_successor_adopts_it_behind_its_router(tmp_path_factory: pytest.TempPathFactory,
                                                               pushed_images: PushedImages) -> None:
    """kill -9 of the server: the next one on its state dir adopts the sandbox, its router with it (the tap,
    the filter: recorded in ns.json), and its containers run on, reachable through the new proxy."""
    import os
    import signal

    from e2b import Sandbox

    port = int(pushed_images.registry.host.rsplit(":", 1)[1])
    env = {**docker_env(port), "AENV_POOL_SIZE": "0", "AENV_PACKAGE_MIRRORS": f"docker=http://{HOST_SERVICES}:{port}"}
    tmp = tmp_path_factory.mktemp("docker-crash")
    srv = start_server(tmp, "ns", env)
    try:
        register_docker(srv)
        sandbox = Sandbox.create("docker", timeout=600, **_sdk(srv))
        sandbox.files.write("/root/www/index.html", PAGE + "\n")
        _root(sandbox, "docker run -d --name web -v /root/www:/www:ro -p 8080:80 busybox:latest httpd -f -p 80 -h /www")
        os.killpg(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(timeout=30)
        srv = start_server(tmp, "ns", env)
        got = httpx.get(srv.url, headers={"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "8080"},
                        timeout=60)
        assert got.status_code == 200 and got.text.strip() == PAGE
        adopted = Sandbox.connect(sandbox.sandbox_id, timeout=600, **_sdk(srv))
        closed = int(srv.url.rsplit(":", 1)[1])
        out = _root(adopted, f"iptables-legacy -F; curl -s -m 5 -o /dev/null -w '%{{http_code}}' "
                             f"http://{HOST_SERVICES}:{closed}/health; true")
        assert out.strip() == "000"
    finally:
        stop_server(srv)

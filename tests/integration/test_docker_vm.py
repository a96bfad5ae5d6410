"""Docker inside a vm sandbox (the ``docker`` template, issue 40), through the unmodified E2B SDK: the guest
boots the docker kernel flavour (netfilter, bridge, veth, cgroup controllers), dockerd runs as the guest's
root, pulls a Docker Hub name through the operator's Docker mirror (the session's local registry, reached
through the allowlist), builds a two-step Dockerfile, runs two containers that find each other by name on a
user network and publishes a port the sandbox proxy reaches. Memory snapshots hold dockerd, containerd and
the containers: four forks of a sandbox with a running container each answer on its published port, and so
do a sandbox resumed from disk and one created from its snapshot. A cold boot on the sandbox's disk (pause
without memory) starts dockerd again.

vm only (``AENV_TEST_RUNTIME=vm``); the ns runtime's Docker inside is ``test_docker_ns.py``. Under TCG
dockerd and runc are ~15x slower than on the host: generous timeouts, no timing assertions."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from aenv.runtime.allowlist import HOST_SERVICES
from aenv.testing.server import API_KEY, Server, discard_vm_state, start_server, stop_server
from tests.fixtures.docker import docker_env, register_docker
from tests.fixtures.plugin import PushedImages

pytestmark = [pytest.mark.sdk, pytest.mark.vm, pytest.mark.timeout(900)]

PAGE = "served-from-a-container-in-a-vm"
WEB = ("docker network create web-net >/dev/null && docker run -d --name web --network web-net "
       "-v /root/www:/www:ro -p 8080:80 busybox:latest httpd -f -p 80 -h /www >/dev/null")


def _vm_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the vm runtime needs root"
    from aenv.config import Settings
    from aenv.runtime.vm.kernel import SOURCE_TARBALL, find_kernel
    from aenv.runtime.vm.runtime import unavailable_reason

    if (why := unavailable_reason(Settings())) is not None:
        return why
    if find_kernel(Settings().cache_dir, "docker") is None and not SOURCE_TARBALL.is_file():
        return "no docker guest kernel and no linux-source-6.1 to build one (aenv setup builds it)"
    return None


@pytest.fixture(scope="module")
def docker_server(tmp_path_factory: pytest.TempPathFactory, pushed_images: PushedImages,
                  runtime_name: str) -> Iterator[Server]:
    if runtime_name != "vm":
        pytest.skip("Docker inside a vm sandbox: AENV_TEST_RUNTIME=vm (the ns runtime's: test_docker_ns.py)")
    if (why := _vm_unavailable()) is not None:
        pytest.skip(f"vm runtime unavailable: {why}")
    if "busybox" in pushed_images.skipped:
        pytest.skip(f"no busybox fixture image: {pushed_images.skipped['busybox']}")
    port = int(pushed_images.registry.host.rsplit(":", 1)[1])
    srv = start_server(tmp_path_factory.mktemp("docker-vm"), "vm", {
        **docker_env(port), "AENV_POOL_SIZE": "0", "AENV_PACKAGE_MIRRORS": f"docker=http://{HOST_SERVICES}:{port}",
        "AENV_VM_RELEASE_PAUSED_AFTER": "0"})  # a pause saves the VM to disk at once: resume loads it back
    try:
        register_docker(srv)
        yield srv
    finally:
        stop_server(srv)
        discard_vm_state(srv.state_dir)


def _sdk(server: Server) -> dict[str, Any]:
    return {"api_key": API_KEY, "api_url": server.url, "sandbox_url": server.url}


@pytest.fixture(scope="module")
def sbx(docker_server: Server) -> Iterator[Any]:
    """The first create boots the template (docker kernel, dockerd up) and snapshots it: minutes under TCG."""
    from e2b import Sandbox

    sandbox = Sandbox.create("docker", timeout=900, request_timeout=900, **_sdk(docker_server))
    yield sandbox
    with contextlib.suppress(Exception):
        sandbox.kill()


def _root(sandbox: Any, cmd: str, timeout: float = 300) -> str:
    return str(sandbox.commands.run(cmd, user="root", timeout=timeout).stdout)


def _page(server: Server, sandbox: Any) -> str:
    """The sandbox's port 8080 through the sandbox proxy, as ``get_host(8080)`` names it."""
    got = httpx.get(server.url, headers={"Host": sandbox.get_host(8080)}, timeout=120)
    assert got.status_code == 200, (got.status_code, got.text)
    return got.text.strip()


@pytest.fixture(scope="module")
def web(sbx: Any) -> Any:
    """A busybox httpd container on a user network, its port 80 published as the sandbox's 8080."""
    sbx.files.write("/root/www/index.html", PAGE + "\n", user="root")
    _root(sbx, WEB)
    return sbx


def test_the_guest_runs_the_docker_kernel_and_dockerd_as_root(sbx: Any) -> None:
    out = _root(sbx, "docker info --format '{{.Driver}} {{.CgroupVersion}} {{.SecurityOptions}}'; "
                     "grep -o aenv.nested=1 /proc/cmdline; stat -f -c %T /run")
    assert out.split()[:2] == ["overlay2", "2"] and "seccomp" in out, out
    assert out.split()[-2:] == ["aenv.nested=1", "tmpfs"], out


def test_docker_run_pulls_a_docker_hub_name_through_the_mirror(sbx: Any) -> None:
    out = _root(sbx, "docker run --rm busybox:latest echo hello-from-a-vm-container")
    assert out.strip() == "hello-from-a-vm-container"
    assert "busybox" in _root(sbx, "docker images --format '{{.Repository}}'")


def test_docker_build_of_a_two_step_dockerfile(sbx: Any) -> None:
    sbx.files.write("/root/ctx/Dockerfile", user="root", data=
                    "FROM busybox:latest\nRUN echo step-one > /one\nRUN cat /one /one > /two\nCMD [\"cat\", \"/two\"]\n")
    _root(sbx, "docker build -q -t aenv-test/two-step /root/ctx")
    assert _root(sbx, "docker run --rm aenv-test/two-step").split() == ["step-one", "step-one"]


def test_containers_find_each_other_and_a_published_port_is_reachable(web: Any, docker_server: Server) -> None:
    by_name = _root(web, "docker run --rm --network web-net busybox:latest sh -c 'for i in $(seq 50); do "
                         "ip=$(busybox nslookup web | sed -n \"s/^Address: *//p\" | tail -1); [ -n \"$ip\" ] && "
                         "printf \"GET / HTTP/1.0\\r\\n\\r\\n\" | busybox nc -w 5 $ip 80 | tail -1 | grep . && break; "
                         "sleep 0.2; done'")
    assert by_name.strip() == PAGE
    assert _page(docker_server, web) == PAGE


def test_fork_x4_every_child_has_the_running_container(web: Any, docker_server: Server) -> None:
    children = web.fork(count=4, timeout=900)
    try:
        assert all(not isinstance(c, Exception) for c in children), children
        for child in children:
            assert _page(docker_server, child) == PAGE
            assert _root(child, "docker exec web cat /www/index.html").strip() == PAGE
        # each child is its own: a page changed in one is not served by another, nor by the source
        children[0].files.write("/root/www/index.html", "changed-in-child-0\n", user="root")
        assert _page(docker_server, children[0]) == "changed-in-child-0"
        assert _page(docker_server, children[1]) == PAGE
        assert _page(docker_server, web) == PAGE
    finally:
        for child in children:
            with contextlib.suppress(Exception):
                child.kill()


def test_pause_to_disk_a_snapshot_and_a_rollback_keep_the_container_running(web: Any, docker_server: Server) -> None:
    from e2b import Sandbox

    assert web.pause()  # released to disk at once (AENV_VM_RELEASE_PAUSED_AFTER=0): QEMU ends
    resumed = Sandbox.connect(web.sandbox_id, timeout=900, **_sdk(docker_server))
    assert _page(docker_server, resumed) == PAGE
    snap = resumed.create_snapshot()
    copy = Sandbox.create(snap.snapshot_id, timeout=900, request_timeout=900, **_sdk(docker_server))
    try:
        assert _page(docker_server, copy) == PAGE
        assert _root(copy, "docker ps --format '{{.Names}}'").split() == ["web"]
    finally:
        copy.kill()
    # rollback (aenv's extension): the container removed after the snapshot runs again, serving its page
    _root(resumed, "docker rm -f web >/dev/null")
    got = httpx.post(f"{docker_server.url}/sandboxes/{resumed.sandbox_id}/rollback",
                     json={"snapshotID": snap.snapshot_id}, headers={"X-API-Key": API_KEY}, timeout=900)
    assert got.status_code == 200, got.text
    back = Sandbox.connect(resumed.sandbox_id, timeout=900, **_sdk(docker_server))
    assert _root(back, "docker ps --format '{{.Names}}'").split() == ["web"]
    assert _page(docker_server, back) == PAGE


def test_a_cold_boot_on_its_disk_starts_dockerd_again(docker_server: Server) -> None:
    """Pause without memory ends QEMU and keeps the disk; resume boots on it. dockerd's pid file of the
    boot before would name a live PID (PIDs repeat from boot to boot) and dockerd would refuse to start:
    the guest's /run is a tmpfs, as on any booted system."""
    from e2b import Sandbox

    sandbox = Sandbox.create("docker", timeout=900, request_timeout=900, **_sdk(docker_server))
    try:
        _root(sandbox, "docker run -d --name sleeper busybox:latest sleep 100000 >/dev/null")
        headers = {"X-API-Key": API_KEY}
        r = httpx.post(f"{docker_server.url}/sandboxes/{sandbox.sandbox_id}/pause", json={"memory": False},
                       headers=headers, timeout=300)
        assert r.status_code == 204, r.text
        r = httpx.post(f"{docker_server.url}/sandboxes/{sandbox.sandbox_id}/connect",
                       json={"timeout": 900, "memory": False}, headers=headers, timeout=900)
        assert r.status_code == 201, r.text
        booted = Sandbox.connect(sandbox.sandbox_id, **_sdk(docker_server))
        out = _root(booted, "docker start sleeper >/dev/null && docker exec sleeper echo started-again")
        assert out.strip() == "started-again"
    finally:
        with contextlib.suppress(Exception):
            sandbox.kill()

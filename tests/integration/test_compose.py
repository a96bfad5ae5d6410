"""Compose sandboxes on a real server (``POST /sandboxes-compose``, docs/docker.md): a two-service project
from the session registry's images, fetched by the node (nothing in the sandbox pulls), reachable through
the sandbox proxy with the unmodified E2B SDK; a build from an uploaded context; a project that does not
come up leaves no sandbox; every refusal is a 400 naming the field; ``docker pull`` typed in a sandbox
goes to the operator's mirror.

The refusals need no Docker. The rest builds the ``docker`` template once per machine (as
``aenv template build docker`` does) and skips, saying why, where it cannot. On both runtimes
(``AENV_TEST_RUNTIME=vm``); on vm a fork x4 of a compose sandbox keeps both services answering in every child."""

from __future__ import annotations

import base64
import io
import tarfile
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from aenv.runtime.allowlist import HOST_SERVICES
from aenv.testing.gateway import serving
from aenv.testing.server import API_KEY, Server, start_server
from tests.fixtures.docker import docker_env, register_docker
from tests.fixtures.plugin import PushedImages

pytestmark = [pytest.mark.sdk, pytest.mark.timeout(900)]  # sdk: the vm pass runs them too

PROJECT = """
services:
  web:
    image: aenv/compose-web:1
    ports: ["8080:80"]
    depends_on:
      backend: {condition: service_healthy}
    healthcheck:
      test: ["CMD", "wget", "-q", "-O-", "http://127.0.0.1/"]
      interval: 1s
      retries: 60
  backend:
    image: busybox:latest
    command: ["sh", "-c", "echo \\"backend-ok $$GREETING\\" > /data/index.html && exec httpd -f -p 8080 -h /data"]
    environment:
      GREETING: ${GREETING}
    volumes: ["data:/data"]
    healthcheck:
      test: ["CMD", "wget", "-q", "-O-", "http://127.0.0.1:8080/"]
      interval: 1s
      retries: 60
volumes:
  data: {}
"""


@pytest.fixture(scope="module")
def compose_server(tmp_path_factory: pytest.TempPathFactory, pushed_images: PushedImages,
                   runtime_name: str) -> Iterator[Server]:
    """A node that runs Docker inside (``ns_nested_containers``, on by default), whose ``docker.io`` is the session
    registry, whose sandboxes may reach that registry (on the host, at 10.0.2.2) and whose Docker mirror it is."""
    pushed_images.require("aenv/compose-web:1")
    reg = pushed_images.registry.url
    port = int(reg.rsplit(":", 1)[1])
    with serving(start_server(tmp_path_factory.mktemp("aenv-compose"), runtime_name, {
            **docker_env(port), "AENV_REGISTRY_MIRRORS": f"docker.io={reg}", "AENV_POOL_SIZE": "0",
            "AENV_PACKAGE_MIRRORS": f"docker=http://{HOST_SERVICES}:{port}"})) as srv:
        yield srv


def api(srv: Server) -> httpx.Client:
    return httpx.Client(base_url=srv.url, headers={"X-API-Key": API_KEY}, timeout=600, trust_env=False)


@pytest.fixture(scope="module")
def docker_ready(compose_server: Server, runtime_name: str) -> Server:
    """The server with the ``docker`` template (built once per machine; skips saying why where it cannot be).
    On vm its snapshot is made here (a boot with dockerd up: a minute under TCG), not in the first test."""
    register_docker(compose_server)
    if runtime_name == "vm":
        from e2b import Sandbox

        Sandbox.create("docker", timeout=60, request_timeout=900).kill()
    return compose_server


def compose_up(srv: Server, **body: Any) -> httpx.Response:
    with api(srv) as c:
        return c.post("/sandboxes-compose", json={"timeout": 300, "startupTimeout": 300, **body})


def by_host(srv: Server, host: str, path: str = "/") -> httpx.Response:
    """A request to ``host`` (``<port>-<id>.localhost:<port>``: what ``get_host`` says) sent to the server."""
    return httpx.get(f"{srv.url}{path}", headers={"Host": host}, timeout=60, trust_env=False)


def test_two_services_come_up_and_answer_through_the_proxy(docker_ready: Server) -> None:
    from e2b import Sandbox

    resp = compose_up(docker_ready, compose=PROJECT, composeEnv={"GREETING": "hi $there"}, metadata={"t": "compose"})
    assert resp.status_code == 201, resp.text
    answer = resp.json()
    sbx = Sandbox.connect(answer["sandboxID"])  # the unmodified SDK on the compose sandbox
    try:
        states = {s["name"]: s for s in answer["compose"]["services"]}
        assert states["web"]["state"] == "running" and states["backend"]["health"] == "healthy", answer
        assert [p["port"] for p in states["web"]["ports"]] == [8080]
        host = sbx.get_host(8080)
        assert states["web"]["ports"][0]["host"] == host
        assert by_host(docker_ready, host).text.strip() == "web-ok"
        # web calls backend by its service name; backend wrote its page into the named volume
        assert by_host(docker_ready, host, "/cgi-bin/backend").text.strip() == "backend-ok hi $there"
        out = sbx.commands.run("docker volume ls -q; docker compose -p aenv ps --services", user="root").stdout
        assert "aenv_data" in out and "backend" in out and "web" in out
        assert sbx.commands.run("docker images --format '{{.Repository}}:{{.Tag}}'", user="root").stdout.count(
            "busybox:latest") == 1
    finally:
        sbx.kill()


def test_fork_x4_of_a_compose_sandbox_keeps_both_services_answering(docker_ready: Server, runtime_name: str) -> None:
    """vm: memory snapshots hold dockerd, containerd and both services; every child answers through the
    proxy, web calling backend by name. (ns answers a fork of such a sandbox with a 409: test_docker_ns.py.)"""
    from e2b import Sandbox

    if runtime_name != "vm":
        pytest.skip("a fork of a sandbox with Docker inside is a 409 on ns (CRIU cannot dump it)")
    resp = compose_up(docker_ready, compose=PROJECT, composeEnv={"GREETING": "forked"})
    assert resp.status_code == 201, resp.text
    sbx = Sandbox.connect(resp.json()["sandboxID"])
    children: list[Any] = []
    try:
        children = sbx.fork(count=4, timeout=600)
        assert all(not isinstance(c, Exception) for c in children), children
        for box in (*children, sbx):
            host = box.get_host(8080)
            assert by_host(docker_ready, host).text.strip() == "web-ok"
            assert by_host(docker_ready, host, "/cgi-bin/backend").text.strip() == "backend-ok forked"
    finally:
        for box in (*children, sbx):
            if not isinstance(box, Exception):
                box.kill()


def context_tar(base: str = "busybox:latest") -> str:
    buf = io.BytesIO()
    files = {"Dockerfile": f"FROM {base}\n".encode() + b"COPY greeting.txt /greeting.txt\nRUN cat /greeting.txt > /built\n"
                           b"CMD [\"sh\", \"-c\", \"httpd -f -p 9000 -h /\"]\n",
             "greeting.txt": b"built-in-the-sandbox\n"}
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("pinned", [False, True], ids=["tag", "digest"])
def test_a_service_is_built_from_its_uploaded_context(docker_ready: Server, pushed_images: PushedImages,
                                                      pinned: bool) -> None:
    """Also from a base pinned by digest: loaded under a tag, the Dockerfile's FROM is pointed at it (else the
    build would ask a registry for the digest)."""
    from e2b import Sandbox

    base = f"busybox@{pushed_images.require('busybox:latest')}" if pinned else "busybox:latest"
    text = "services:\n  app:\n    build: ./app\n    ports: ['9000:9000']\n"
    resp = compose_up(docker_ready, compose=text, buildContexts={"app": context_tar(base)})
    assert resp.status_code == 201, resp.text
    sbx = Sandbox.connect(resp.json()["sandboxID"])
    try:
        assert by_host(docker_ready, sbx.get_host(9000), "/built").text == "built-in-the-sandbox\n"
        if pinned:  # built on the image the node loaded, not on a pull of the digest through the mirror
            digests = sbx.commands.run("docker images --digests --format '{{.Repository}} {{.Digest}}'", user="root")
            assert base.split("@")[1] not in digests.stdout, digests.stdout
    finally:
        sbx.kill()


def test_a_project_that_does_not_come_up_leaves_no_sandbox(docker_ready: Server) -> None:
    text = ("services:\n  sick:\n    image: busybox:latest\n    command: ['sleep', '600']\n    healthcheck:\n"
            "      test: ['CMD', 'false']\n      interval: 1s\n      retries: 2\n")
    resp = compose_up(docker_ready, compose=text, startupTimeout=120, metadata={"t": "sick"})
    assert resp.status_code == 500, resp.text
    assert resp.json()["reason"] == "compose" and "sick" in resp.json()["message"]
    with api(docker_ready) as c:
        left = c.get("/v2/sandboxes", params={"metadata": "t=sick", "state": "running,paused"}).json()
    assert left == []


def test_docker_pull_in_a_sandbox_goes_to_the_operators_mirror(docker_ready: Server) -> None:
    from e2b import Sandbox

    sbx = Sandbox.create("docker", timeout=300)
    try:
        res = sbx.commands.run("docker pull -q busybox:latest && docker run --rm busybox:latest echo pulled-ok",
                               user="root", timeout=300)
        assert "pulled-ok" in res.stdout
    finally:
        sbx.kill()


def svc(line: str) -> str:
    return f"services:\n  a:\n    image: busybox:latest\n    {line}\n"


REFUSALS = [
    (svc("volumes: ['/etc:/host-etc']"), "services.a.volumes[0]: host bind mounts"),
    (svc("volumes: [{type: bind, source: ., target: /src}]"), "services.a.volumes[0].type: bind"),
    (svc("privileged: true"), "services.a.privileged"),
    (svc("network_mode: host"), "services.a.network_mode"),
    (svc("pid: host"), "services.a.pid"),
    (svc("ipc: host"), "services.a.ipc"),
    (svc("devices: ['/dev/fuse:/dev/fuse']"), "services.a.devices"),
    (svc("cap_add: [SYS_ADMIN]"), "services.a.cap_add: SYS_ADMIN"),
    (svc("networks: [outside]") + "networks:\n  outside:\n    external: true\n", "networks.outside.external"),
    (svc("volumes: ['ext:/x']") + "volumes:\n  ext:\n    external: true\n", "volumes.ext.external"),
    ("services:\n" + "".join(f"  s{i}:\n    image: busybox\n" for i in range(25)), "25 services, the limit is 24"),
    (svc("command: ['true']") + "#" * (1 << 20), "bytes, the limit is 1048576"),
]


@pytest.mark.parametrize(("text", "named"), REFUSALS, ids=[r[1].split(":")[0] for r in REFUSALS])
def test_each_refusal_is_a_400_naming_the_field(compose_server: Server, text: str, named: str) -> None:
    resp = compose_up(compose_server, compose=text, metadata={"t": "refused"})
    assert resp.status_code == 400, resp.text
    assert resp.json()["code"] == 400 and named in resp.json()["message"]
    with api(compose_server) as c:
        assert c.get("/v2/sandboxes", params={"metadata": "t=refused"}).json() == []

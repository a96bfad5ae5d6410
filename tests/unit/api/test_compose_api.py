"""``POST /sandboxes-compose`` against a fake runtime whose envd runs a script instead of Docker: the answer's
shape, what is uploaded into the sandbox, and that every failure after the create kills the sandbox."""

from __future__ import annotations

import base64
import io
import json
import tarfile
from collections.abc import Callable
from gzip import decompress as gunzip
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from starlette.testclient import TestClient

from tests.fixtures.fakes import FakeRegistry, layer_with, sha
from tests.fixtures.runtime import FakeRuntime

PROJECT = """
services:
  web:
    image: web:1
    ports: ["8080:80"]
    environment:
      PRICE: "$$5 ${CURRENCY}"
    depends_on:
      api: {condition: service_healthy}
  api:
    build: ./api
    healthcheck: {test: ["CMD", "true"], interval: 1s}
"""
PS = [
    {"Service": "web", "State": "running", "Health": "", "ExitCode": 0,
     "Publishers": [{"URL": "0.0.0.0", "TargetPort": 80, "PublishedPort": 8080, "Protocol": "tcp"},
                    {"URL": "::", "TargetPort": 80, "PublishedPort": 8080, "Protocol": "tcp"}]},
    {"Service": "api", "State": "running", "Health": "healthy", "ExitCode": 0, "Publishers": []},
]


def envelope(msg: dict[str, Any], flags: int = 0) -> bytes:
    data = json.dumps(msg).encode()
    return bytes([flags]) + len(data).to_bytes(4, "big") + data


class ScriptedEnvd:
    """envd as far as the compose flow uses it: ``/files`` uploads are kept, each ``Process.Start`` runs
    ``script(cmd)`` for (exit code, output)."""

    def __init__(self, script: Callable[[str], tuple[int, str]]) -> None:
        self.script = script
        self.files: dict[str, bytes] = {}
        self.commands: list[str] = []

    def stream(self) -> Any:
        envd = self

        class Stream:
            buffered = False

            def __init__(self) -> None:
                self.sent = bytearray()
                self.answer: bytes | None = None

            async def write(self, data: bytes) -> None:
                self.sent += data

            async def read(self, n: int = 65536) -> bytes:
                if self.answer is None:
                    self.answer = envd.answer(bytes(self.sent))
                out, self.answer = self.answer[:n], self.answer[n:]
                return out

            async def write_eof(self) -> None: ...

            async def aclose(self) -> None: ...

        return Stream()

    def answer(self, raw: bytes) -> bytes:
        head, _, body = raw.partition(b"\r\n\r\n")
        target = head.split(b"\r\n")[0].split()[1].decode()
        if target.startswith("/files"):
            self.files[parse_qs(urlsplit(target).query)["path"][0]] = body
            payload = b"[]"
        else:
            cmd = json.loads(body[5:])["process"]["args"][-1]
            self.commands.append(cmd)
            code, out = self.script(cmd)
            payload = envelope({"event": {"data": {"stdout": base64.b64encode(out.encode()).decode()}}}) + envelope(
                {"event": {"end": {"exitCode": code}}})
        return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload


def add_image(fake: FakeRegistry, repo: str, tag: str) -> None:
    blob = layer_with(repo, repo.encode())
    config = {"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": [sha(gunzip(blob))]}}
    fake.add_image(repo, tag, [blob], config)


def ok_script(cmd: str) -> tuple[int, str]:
    if " ps -a --format json" in cmd:
        return 0, "\n".join(json.dumps(r) for r in PS)
    return 0, "Loaded image: web:1\n" if "docker load" in cmd else ""


@pytest.fixture
def compose_client(client: TestClient, runtime: FakeRuntime, tmp_path: Path,
                   fake_registry: FakeRegistry) -> tuple[TestClient, ScriptedEnvd]:
    client.app_state.catalog.register(alias="docker", kind="bootstrap", rootfs=tmp_path / "rootfs",
                                      template_id="docker", config={"nested_containers": True})
    add_image(fake_registry, "library/web", "1")
    add_image(fake_registry, "library/busybox", "latest")
    client.app_state.orchestrator.template_flows.builder.client = fake_registry.client()
    envd = ScriptedEnvd(ok_script)

    async def open_stream(sandbox_id: str, port: int) -> Any:
        assert runtime.sandboxes.get(sandbox_id) == "running"
        return envd.stream()

    runtime.open_stream = open_stream  # type: ignore[method-assign]
    return client, envd


@pytest.fixture
def fake_registry() -> FakeRegistry:
    return FakeRegistry()


def context_b64() -> str:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        data = b"FROM busybox:latest\nCMD [\"true\"]\n"
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return base64.b64encode(buf.getvalue()).decode()


def body(**extra: Any) -> dict[str, Any]:
    return {"compose": PROJECT, "composeEnv": {"CURRENCY": "EUR"}, "buildContexts": {"api": context_b64()},
            "timeout": 120, "metadata": {"task": "t1"}, **extra}


def test_a_project_comes_up_and_answers_the_sandbox_and_its_services(
        compose_client: tuple[TestClient, ScriptedEnvd], fake_registry: FakeRegistry, runtime: FakeRuntime) -> None:
    client, envd = compose_client
    resp = client.post("/sandboxes-compose", json=body())
    assert resp.status_code == 201, resp.text
    out = resp.json()
    sid = out["sandboxID"]
    assert out["templateID"] == "docker" and out["envdAccessToken"]  # E2B's create answer: Sandbox.connect works
    assert client.get(f"/sandboxes/{sid}").json()["metadata"] == {"task": "t1"}
    web, api = out["compose"]["services"]
    assert out["compose"]["project"] == "aenv"
    assert web == {"name": "web", "state": "running", "health": None, "exitCode": 0, "ports": [
        {"port": 8080, "target": 80, "protocol": "tcp", "host": f"8080-{sid}.{out['domain']}"}]}
    assert api["health"] == "healthy" and api["ports"] == []
    compose = envd.files["/var/lib/aenv-compose/compose.yaml"].decode()
    assert "$$5 EUR" in compose and "docker.io/library/web:1" in compose  # interpolated once, escaped, renamed
    assert "/var/lib/aenv-compose/build/api" in compose
    with tarfile.open(fileobj=io.BytesIO(envd.files["/var/lib/aenv-compose/images.tar"])) as tar:
        tags = [m["RepoTags"] for m in json.loads(tar.extractfile("manifest.json").read())]  # type: ignore[union-attr]
    assert sorted(tags) == [["docker.io/library/busybox:latest"], ["docker.io/library/web:1"]]  # the build's FROM too
    up = next(c for c in envd.commands if " up -d --wait" in c)
    assert "--pull never" in up and "-p aenv" in up
    assert ("kill", sid) not in runtime.calls


def test_fetching_nothing_unknown_a_missing_image_is_a_400_before_any_sandbox(
        compose_client: tuple[TestClient, ScriptedEnvd], runtime: FakeRuntime, fake_registry: FakeRegistry) -> None:
    client, _ = compose_client
    resp = client.post("/sandboxes-compose", json={"compose": "services:\n  a:\n    image: nosuch:1\n"})
    assert resp.status_code == 400 and "services.a.image 'nosuch:1'" in resp.json()["message"]
    assert not [c for c in runtime.calls if c[0] == "create"]


@pytest.mark.parametrize(("extra", "match"), [
    ({"compose": "services:\n  a:\n    image: busybox\n    privileged: true\n"}, "services.a.privileged"),
    ({"compose": "services:\n  a:\n    image: busybox\n    volumes: ['/:/host']\n"}, "services.a.volumes[0]"),
    ({"buildContexts": {"api": "%%%"}}, "buildContexts.api: not base64"),
    ({"buildContexts": {"web": context_b64()}}, "buildContexts.web"),
    ({"profiles": [""]}, "profiles"),
    ({"startupTimeout": 0}, "startupTimeout"),
    ({"frobnicate": 1}, "frobnicate"),
])
def test_bad_requests_are_400s_and_start_nothing(compose_client: tuple[TestClient, ScriptedEnvd], runtime: FakeRuntime,
                                                  extra: dict[str, Any], match: str) -> None:
    client, _ = compose_client
    resp = client.post("/sandboxes-compose", json=body(**extra))
    assert resp.status_code == 400 and match in resp.json()["message"], resp.text
    assert not [c for c in runtime.calls if c[0] == "create"]


def test_a_failed_up_kills_the_sandbox_and_answers_composes_output(
        compose_client: tuple[TestClient, ScriptedEnvd], runtime: FakeRuntime) -> None:
    client, envd = compose_client

    def failing(cmd: str) -> tuple[int, str]:
        if " up -d --wait" in cmd:
            return 1, "container aenv-api-1 is unhealthy"
        if " logs " in cmd:
            return 0, "api-1  | boom"
        return ok_script(cmd)

    envd.script = failing
    resp = client.post("/sandboxes-compose", json=body())
    assert resp.status_code == 500, resp.text
    answer = resp.json()
    assert answer["reason"] == "compose" and "aenv-api-1 is unhealthy" in answer["message"] and "boom" in answer["message"]
    created = [sid for kind, sid in runtime.calls if kind == "create"]
    assert len(created) == 1 and ("kill", created[0]) in runtime.calls
    assert client.get(f"/sandboxes/{created[0]}").status_code == 404


def test_a_template_without_docker_is_refused_and_its_sandbox_killed(
        compose_client: tuple[TestClient, ScriptedEnvd], runtime: FakeRuntime) -> None:
    client, _ = compose_client
    resp = client.post("/sandboxes-compose", json=body(templateID="base"))
    assert resp.status_code == 400 and "templateID: template 'base' has no Docker inside" in resp.json()["message"]
    created = [sid for kind, sid in runtime.calls if kind == "create"]
    assert ("kill", created[0]) in runtime.calls

"""`aenv pull` of each fixture image through the server, then Sandbox.create(name) + commands.run via the SDK."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from aenv.testing.server import API_KEY, Server, discard_vm_state, start_server, stop_server
from tests.fixtures.plugin import PushedImages

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the ns runtime needs root")


@pytest.fixture(scope="module")
def mirror_server(
    tmp_path_factory: pytest.TempPathFactory, pushed_images: PushedImages, runtime_name: str
) -> Iterator[Server]:
    srv = start_server(
        tmp_path_factory.mktemp("pull-server"),
        runtime_name,
        {"AENV_REGISTRY_MIRRORS": f"docker.io={pushed_images.registry.url}", "AENV_POOL_SIZE": "0"},
    )
    yield srv
    stop_server(srv)
    discard_vm_state(srv.state_dir)  # vm: its template RAM stays mounted in /dev/shm otherwise


def aenv(server: Server, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "AENV_SERVER": server.url, "NO_PROXY": "127.0.0.1,localhost",
           "PYTHONPATH": server.env["PYTHONPATH"]}  # the CLI of the aenv under test, as the server  # fmt: skip
    return subprocess.run([sys.executable, "-m", "aenv.cli.main", *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize(
    ("image", "name", "probe", "expect"),
    [
        ("busybox:latest", "busybox", "busybox | head -1", "BusyBox"),
        ("ubuntu:22.04", "ubuntu", "cat /etc/debian_version; python3 -c 'print(6*7)'", "42"),
        ("alpine:3.23", "alpine", "cat /etc/alpine-release; id -un", "user"),
    ],
)
def test_pull_then_sdk(
    mirror_server: Server, pushed_images: PushedImages, image: str, name: str, probe: str, expect: str
) -> None:
    pushed_images.require(image)
    r = aenv(mirror_server, "pull", image, "--name", name)
    assert r.returncode == 0, r.stderr
    assert f"template {name}" in r.stdout and "layers" in r.stdout
    again = aenv(mirror_server, "pull", image, "--name", name, "-q")
    assert again.returncode == 0 and again.stdout.strip()
    from e2b import Sandbox

    sbx = Sandbox.create(name, api_url=mirror_server.url, sandbox_url=mirror_server.url, api_key=API_KEY)
    try:
        out = sbx.commands.run(probe)
        assert expect in out.stdout
        sbx.files.write("/home/user/f.txt", "image-file")
        assert sbx.files.read("/home/user/f.txt") == "image-file"
    finally:
        sbx.kill()
    listed = json.loads(aenv(mirror_server, "template", "ls", "-o", "json").stdout)
    assert any(name in t["aliases"] for t in listed)


def test_pull_unknown_image_names_the_reference(mirror_server: Server) -> None:
    r = aenv(mirror_server, "pull", "no-such-image:9.9")
    assert r.returncode != 0
    assert "no-such-image" in r.stderr and "error:" in r.stderr
    resp = httpx.post(
        mirror_server.url + "/aenv/templates/pull", json={"image": "::bad::"}, headers={"X-API-KEY": API_KEY}, trust_env=False
    )
    assert resp.status_code == 400 and resp.json()["code"] == 400


def test_cache_ls_and_template_rm(mirror_server: Server, pushed_images: PushedImages) -> None:
    pushed_images.require("busybox:latest")
    assert aenv(mirror_server, "pull", "busybox:latest", "--name", "bb2").returncode == 0
    data = json.loads(aenv(mirror_server, "cache", "ls", "-o", "json").stdout)
    assert data["usage"]["entries"] >= 1 and data["usage"]["pinned"] > 0
    assert aenv(mirror_server, "template", "rm", "bb2").returncode == 0
    listed = json.loads(aenv(mirror_server, "template", "ls", "-o", "json").stdout)
    assert not any("bb2" in t["aliases"] for t in listed)
    assert aenv(mirror_server, "cache", "prune").returncode == 0

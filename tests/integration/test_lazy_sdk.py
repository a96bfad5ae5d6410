"""Lazy images through the server and the E2B SDK: pull (no layers), create, run, ``aenv cache ls`` / ``pin``.

The artifact is published first by a builder acting as another node (lazy on, full pull, conversion).
The server (``AENV_LAZY_IMAGES=true``) then finds it and serves the template from aenv-lazyd.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from aenv.images.lazy.lazyd import LazyDaemon, fuse_support
from aenv.images.lazy.publish import find_in_registry
from aenv.images.reference import parse_reference
from aenv.images.registry import RegistryClient
from aenv.images.templates import ImageBuilder
from aenv.testing.server import API_KEY, Server, discard_vm_state, start_server, stop_server
from tests.fixtures import images as fx
from tests.fixtures.lazyimage import build_layers, push_unique
from tests.fixtures.oci import image_config, push_image
from tests.fixtures.plugin import PushedImages, make_settings
from tests.fixtures.throttle import Throttle
from tests.integration.conftest import _needs_runtime
from tests.integration.test_pull_sdk import aenv

pytestmark = [
    pytest.mark.skipif(fuse_support() is not None, reason=f"no FUSE here: {fuse_support()}"),
]


def push_fresh_busybox(pushed: PushedImages) -> str:
    """busybox under a digest no earlier run has pulled (the servers' cache dir is shared)."""
    image = fx.busybox_image()
    ref = f"aenv/lazy-bb:{uuid.uuid4().hex[:8]}"

    async def go() -> None:
        async with RegistryClient(mirrors={"docker.io": pushed.registry.url}) as client:
            cfg = image_config(image.layers, cmd=image.cmd, env={"PATH": "/bin:/usr/bin", "FRESH": ref})
            await push_image(client, ref, image.layers, cfg)

    asyncio.run(go())
    return ref


def publish_from_another_node(tmp: Path, pushed: PushedImages, image: str) -> None:
    async def go() -> None:
        s = make_settings(tmp, pushed.registry, lazy_images=True)
        b = ImageBuilder(s, client=RegistryClient.from_settings(s, attempts=3, backoff=0.01))
        try:
            full = await b.pull(image)
            assert full.lazy_root is None
            await b.lazy.wait_converted()
        finally:
            await b.aclose()

    asyncio.run(go())


LINKS: dict[str, Throttle] = {}  # each server's link to the registry (a proxy the last test cuts)


def recorded_prefetch(srv: Server, wait: float = 20.0) -> list[int]:
    async def go() -> list[int]:
        async with RegistryClient(mirrors={"docker.io": srv.env["AENV_REGISTRY_MIRRORS"].split("=", 1)[1]}) as c:
            ref = parse_reference(srv.env["LAZY_TEST_IMAGE"])  # via the link: same registry
            digest = (await c.resolve(ref)).manifest_digest
            deadline = time.monotonic() + wait
            while True:
                art = await find_in_registry(c, ref, digest)
                if (art and art.index.prefetch) or time.monotonic() > deadline:
                    return list(art.index.prefetch) if art else []
                await asyncio.sleep(0.2)

    return asyncio.run(go())


@pytest.fixture(scope="module")
def lazy_server(
    tmp_path_factory: pytest.TempPathFactory, pushed_images: PushedImages, runtime_name: str
) -> Iterator[Server]:
    _needs_runtime(runtime_name)
    pushed_images.require("busybox:latest")
    image = push_fresh_busybox(pushed_images)
    publish_from_another_node(tmp_path_factory.mktemp("node-a"), pushed_images, image)
    link = Throttle(int(pushed_images.registry.host.rsplit(":", 1)[1]), bits_per_s=1e10, rtt=0)
    srv = start_server(
        tmp_path_factory.mktemp("lazy-server"),
        runtime_name,
        {
            "AENV_REGISTRY_MIRRORS": f"docker.io=http://127.0.0.1:{link.port}",
            "AENV_POOL_SIZE": "0",
            "AENV_LAZY_IMAGES": "true",
            "AENV_LAZY_CACHE_BYTES": str(256 << 20),
        },
    )
    srv.env["LAZY_TEST_IMAGE"] = image
    LINKS[srv.url] = link
    yield srv
    stop_server(srv)
    link.close()
    discard_vm_state(srv.state_dir)
    for root in sorted((srv.state_dir / "lazy" / "roots").glob("*")):  # the server leaves them (sandboxes may run)
        subprocess.run(["umount", str(root)], check=False, capture_output=True)
    LazyDaemon(srv.state_dir / "lazy", 0).stop()


def test_lazy_template_runs_and_the_cache_commands_show_it(lazy_server: Server) -> None:
    r = aenv(lazy_server, "pull", lazy_server.env["LAZY_TEST_IMAGE"], "--name", "lbb")
    assert r.returncode == 0, r.stderr
    info = httpx.get(lazy_server.url + "/aenv/info", headers={"X-API-KEY": API_KEY}, trust_env=False).json()
    assert info["capabilities"]["lazy_images"] is True
    from e2b import Sandbox

    sbx = Sandbox.create("lbb", api_url=lazy_server.url, sandbox_url=lazy_server.url, api_key=API_KEY)
    try:
        assert "BusyBox" in sbx.commands.run("busybox | head -1").stdout
        sbx.files.write("/home/user/f.txt", "on a lazy lower")
        assert sbx.files.read("/home/user/f.txt") == "on a lazy lower"
    finally:
        sbx.kill()
    assert recorded_prefetch(lazy_server)  # the first start's chunks, published with the index
    listing = json.loads(aenv(lazy_server, "cache", "ls", "-o", "json").stdout)
    (img,) = listing["lazy"]["images"]
    assert img["templates"] == ["lbb"] and 0 < img["fetched"] <= img["stored"] and img["cached"] > 0
    table = aenv(lazy_server, "cache", "ls")
    assert "lazy images:" in table.stdout and "lbb" in table.stdout
    pin = aenv(lazy_server, "cache", "pin", "lbb")
    assert pin.returncode == 0 and "pinned" in pin.stdout, pin.stderr
    (img,) = json.loads(aenv(lazy_server, "cache", "ls", "-o", "json").stdout)["lazy"]["images"]
    assert img["pinned"] and img["fetched"] == img["stored"]
    not_lazy = aenv(lazy_server, "cache", "pin", "base")
    assert not_lazy.returncode != 0 and "not a lazy image" in not_lazy.stderr



def test_a_killed_reader_is_restarted_and_new_sandboxes_run(lazy_server: Server) -> None:
    from e2b import Sandbox

    if aenv(lazy_server, "template", "ls", "-o", "json").stdout.count('"lbb"') == 0:
        assert aenv(lazy_server, "pull", lazy_server.env["LAZY_TEST_IMAGE"], "--name", "lbb").returncode == 0
    d = LazyDaemon(lazy_server.state_dir / "lazy", 0)
    pid = d.pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not (d.alive() and d.pid() != pid and all(_readable(r) for r in (d.root / "roots").iterdir())):
        assert time.monotonic() < deadline, "aenv-lazyd was not restarted, or its roots not remounted"
        time.sleep(0.2)
    sbx = Sandbox.create("lbb", api_url=lazy_server.url, sandbox_url=lazy_server.url, api_key=API_KEY)
    try:
        assert "BusyBox" in sbx.commands.run("busybox | head -1").stdout
    finally:
        sbx.kill()
    assert "aenv-lazyd is gone" in lazy_server.log_path.read_text()

def _readable(root: Path) -> bool:
    try:
        os.listdir(root)
    except OSError:
        return False
    return os.path.ismount(root)


@pytest.mark.slow
def test_sixteen_concurrent_cold_creates_fetch_each_chunk_once(
    lazy_server: Server, pushed_images: PushedImages, tmp_path: Path
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from e2b import Sandbox

    image = push_fresh_busybox(pushed_images)
    publish_from_another_node(tmp_path / "node-a", pushed_images, image)
    assert aenv(lazy_server, "pull", image, "--name", "l16").returncode == 0

    def one(_: int) -> str:
        sbx = Sandbox.create("l16", api_url=lazy_server.url, sandbox_url=lazy_server.url, api_key=API_KEY)
        try:
            return str(sbx.commands.run("busybox | head -1; ls -R /bin /etc | wc -l").stdout)
        finally:
            sbx.kill()

    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(one, range(16)))
    assert all("BusyBox" in o for o in outs) and len(set(outs)) == 1
    listing = json.loads(aenv(lazy_server, "cache", "ls", "-o", "json").stdout)
    (img,) = [i for i in listing["lazy"]["images"] if i["templates"] == ["l16"]]
    assert img["max_fetches_per_chunk"] == 1 and 0 < img["fetched"] <= img["stored"]


def test_an_unreachable_registry_is_eio_in_the_sandbox_and_in_the_server_log(
    lazy_server: Server, pushed_images: PushedImages, tmp_path: Path
) -> None:
    """Last in this module: it cuts the server's link to the registry."""
    from e2b import Sandbox
    from e2b.sandbox.commands.command_handle import CommandExitException

    layers, cmd = build_layers(tmp_path, 24)

    async def push() -> str:
        async with RegistryClient(mirrors={"docker.io": pushed_images.registry.url}) as client:
            return (await push_unique(client, "aenv/lazy-cut", layers, cmd))[0]

    image = asyncio.run(push())
    publish_from_another_node(tmp_path / "node-a", pushed_images, image)
    assert aenv(lazy_server, "pull", image, "--name", "lcut").returncode == 0
    sbx = Sandbox.create("lcut", api_url=lazy_server.url, sandbox_url=lazy_server.url, api_key=API_KEY)
    try:
        assert "blob0000" in sbx.commands.run("ls /payload").stdout
        LINKS[lazy_server.url].cut_link()
        with pytest.raises(CommandExitException) as exc:
            sbx.commands.run("cat /payload/blob0002 > /dev/null")
        assert "I/O error" in str(exc.value) or "Input/output error" in str(exc.value)
    finally:
        sbx.kill()
    deadline = time.monotonic() + 10
    while "aenv-lazyd: " not in lazy_server.log_path.read_text():
        assert time.monotonic() < deadline, "the daemon's error did not reach the server's log"
        time.sleep(0.2)
    assert "lazy fetch failed" in lazy_server.log_path.read_text()

"""Pulled images run in the ns runtime: image → PulledImage → SandboxImage → sandbox → envd command.

Covers images without bash (busybox, Alpine/musl) and the multi-layer Debian images with whiteouts.
Needs root and cgroups (the ns runtime's requirements); skips otherwise.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from aenv.config import Settings, default_cache_dir
from aenv.core.templates import sandbox_image_of
from aenv.images.registry import RegistryClient
from aenv.images.templates import ImageBuilder
from aenv.runtime.ns import NsRuntime
from tests.fixtures.plugin import PushedImages, make_settings
from tests.integration.test_ns_runtime import run_cmd, spec_for

pytestmark = [pytest.mark.asyncio(loop_scope="module")]


@pytest.fixture(scope="module")
def rt_settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    if os.geteuid() != 0 or not Path("/sys/fs/cgroup").is_dir():
        pytest.skip("the ns runtime needs root and cgroups")
    cache = Path(os.environ.get("AENV_CACHE_DIR") or default_cache_dir())
    return Settings(state_dir=tmp_path_factory.mktemp("state"), cache_dir=cache, pool_size=0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rt(rt_settings: Settings) -> AsyncIterator[NsRuntime]:
    runtime = NsRuntime(rt_settings, pool_size=0)
    await runtime.start()
    await runtime.reconcile(set())
    yield runtime
    for sid in list(runtime.table.running):
        await runtime.kill(sid)
    await runtime.close()
    await runtime.reconcile(set())


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def images(
    pushed_images: PushedImages,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[ImageBuilder]:
    s = make_settings(tmp_path_factory.mktemp("img"), pushed_images.registry)
    b = ImageBuilder(s, client=RegistryClient.from_settings(s, attempts=3, backoff=0.01))
    yield b
    await b.aclose()


SCRIPT = (
    "id -un; echo $HOME; pwd; touch $HOME/f-$(id -u) /tmp/t-$(id -u) && echo write-ok; "
    "head -1 /etc/os-release 2>/dev/null; command -v python3 || true"
)


@pytest.mark.parametrize("name", ["busybox:latest", "alpine:3.23", "ubuntu:22.04", "aenv/debian-app:1"])
async def test_image_runs_in_ns_sandbox(
    rt: NsRuntime,
    rt_settings: Settings,
    images: ImageBuilder,
    pushed_images: PushedImages,
    name: str,
) -> None:
    pushed_images.require(name)
    tpl = await images.pull(name)
    spec = spec_for(rt_settings, sandbox_image_of(tpl, name.replace("/", "-").replace(":", "-")))
    await rt.create(spec)
    try:
        code, out, err = await run_cmd(rt, spec.sandbox_id, SCRIPT, user="user")
        assert code == 0, err
        lines = out.splitlines()
        assert lines[:2] == ["user", "/home/user"] and "write-ok" in lines
        code, out, err = await run_cmd(rt, spec.sandbox_id, SCRIPT, user="root")
        assert code == 0 and out.splitlines()[0] == "root" and "write-ok" in out, err
        if "alpine" in name:
            assert 'NAME="Alpine Linux"' in out
        if "ubuntu" in name or "debian" in name:
            assert "/usr/bin/python3" in out and "bookworm" in out
        if name.startswith("aenv/debian-app"):
            code, out, _ = await run_cmd(rt, spec.sandbox_id, "python3 hello.py; ls /etc/motd || echo gone")
            assert out.splitlines() == ["hello from layer 3", "gone"]
    finally:
        await rt.kill(spec.sandbox_id)

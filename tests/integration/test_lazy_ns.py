"""A lazy image on the ns runtime: one node pulls whole and publishes; a fresh node starts on demand.

Node A (lazy_images on) pulls busybox from the local registry, converts it in the background and
publishes the artifact to that registry (fallback tag). Node B, with an empty cache, finds the artifact:
no layer is pulled, the template's lower is the lazy ext4 loop-mounted from aenv-lazyd, and a sandbox
runs on it with only the chunks it touched fetched.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.core.templates import sandbox_image_of
from aenv.images.lazy.lazyd import fuse_support
from aenv.images.registry import RegistryClient
from aenv.images.templates import ImageBuilder
from aenv.runtime.ns import NsRuntime
from tests.fixtures.plugin import PushedImages, make_settings
from tests.integration import test_images_ns
from tests.integration.test_ns_runtime import run_cmd, spec_for

pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(fuse_support() is not None, reason=f"no FUSE here: {fuse_support()}"),
]


@pytest.fixture(scope="module")
def rt_settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    if os.geteuid() != 0 or not Path("/sys/fs/cgroup").is_dir():
        pytest.skip("the ns runtime needs root and cgroups")
    tmp = tmp_path_factory.mktemp("lazyrt")
    return Settings(state_dir=tmp / "state", cache_dir=tmp / "cache", pool_size=0)


rt = test_images_ns.rt  # the ns runtime fixture, on this module's rt_settings


def node(tmp: Path, pushed: PushedImages) -> ImageBuilder:
    s = make_settings(tmp, pushed.registry, lazy_images=True, lazy_cache_bytes=64 << 20)
    return ImageBuilder(s, client=RegistryClient.from_settings(s, attempts=3, backoff=0.01))


async def test_second_node_starts_busybox_on_demand(
    rt: NsRuntime, rt_settings: Settings, pushed_images: PushedImages, tmp_path: Path
) -> None:
    pushed_images.require("busybox:latest")
    a = node(tmp_path / "a", pushed_images)
    try:
        full = await a.pull("busybox:latest")
        assert full.lazy_root is None and full.layers
        await a.lazy.wait_converted()
    finally:
        await a.aclose()
    b = node(tmp_path / "b", pushed_images)
    sid = None
    try:
        tpl = await b.pull("busybox:latest")
        assert tpl.lazy_root is not None and tpl.layers == () and tpl.download_bytes == 0
        assert tpl.lowers == (tpl.lazy_root,) and os.path.ismount(tpl.lazy_root)
        spec = spec_for(rt_settings, sandbox_image_of(tpl, "lazy-busybox"))
        sid = spec.sandbox_id
        await rt.create(spec)
        code, out, err = await run_cmd(
            rt, sid, "id -un; echo hi > /tmp/x && cat /tmp/x; ls /bin | wc -l", user="user"
        )
        assert code == 0, err
        lines = out.split()
        assert lines[:2] == ["user", "hi"] and int(lines[2]) > 10
        name = tpl.lazy_file.stem if tpl.lazy_file else ""
        st = b.lazy.daemon.stats(name)
        assert 0 < st["fetched"] <= st["stored"] and st["max_fetches_per_chunk"] == 1
        again = await b.pull("busybox:latest")  # the image.json of a mounted lazy image is reused
        assert again.lazy_root == tpl.lazy_root
    finally:
        if sid is not None:
            await rt.kill(sid)
        b.lazy.unmount_all()
        await b.aclose()

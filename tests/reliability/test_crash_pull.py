"""Crash safety of image pulls: SIGKILL the server in the middle of writing a layer, restart, pull again.

The image has a layer nobody has pulled before (random bytes), so the download really happens and the
``pull.layer`` fault point fires inside it. After the restart the layer cache must hold no scratch of
the dead process and no half-written layer, no template may be half-registered, and a second pull must
complete and give a working sandbox.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import tarfile
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from aenv.images.registry import RegistryClient
from tests.fixtures import images as fx
from tests.fixtures.oci import image_config, layer_from_tar, push_image, tar_entries
from tests.fixtures.registry import LocalRegistry
from tests.reliability.helpers import HEADERS, ServerFactory, api, leaks, sdk_kwargs, wait_dead


def _unique_image(reg: LocalRegistry, work: Path) -> str:
    """busybox plus a fresh 4 MiB random layer, pushed under a fresh tag; returns the reference."""
    work.mkdir(parents=True, exist_ok=True)
    try:
        base = fx.busybox_image()
    except fx.FixtureUnavailable as exc:
        pytest.skip(f"busybox fixture unavailable: {exc}")
    marker = tarfile.TarInfo("marker.bin")
    marker.mode = 0o644
    raw = tar_entries(work / "extra.tar", [(marker, secrets.token_bytes(4 << 20))])
    extra = layer_from_tar(raw, work / "extra.tar.gz", "gzip")
    tag = f"crashtest/img:{secrets.token_hex(4)}"

    async def push() -> None:
        async with RegistryClient(mirrors={"docker.io": reg.url}) as client:
            layers = [*base.layers, extra]
            await push_image(client, tag, layers, image_config(layers, cmd=base.cmd))

    asyncio.run(push())
    return tag


def _pull(server_url: str, image: str, name: str) -> list[dict[str, object]]:
    with httpx.stream("POST", server_url + "/aenv/templates/pull", json={"image": image, "name": name},
                      headers=HEADERS, timeout=300, trust_env=False) as resp:
        return [json.loads(line) for line in resp.iter_lines() if line.strip()]


def test_crash_mid_layer_then_pull_again(
    tmp_path: Path, runtime_name: str, local_registry: LocalRegistry
) -> None:
    image = _unique_image(local_registry, tmp_path / "img")
    factory = ServerFactory(tmp_path / "srv", runtime_name,
                            {"AENV_POOL_SIZE": "0", "AENV_REGISTRY_MIRRORS": f"docker.io={local_registry.url}"})
    try:
        first = factory.start(faults="pull.layer")
        with pytest.raises(Exception):  # noqa: B017 - the server dies: any client error
            events = _pull(first.url, image, "crashy")
            raise AssertionError(f"pull finished despite the fault: {events[-1:]}")
        assert wait_dead(first) == -9
        assert "fault point pull.layer fired" in first.log_tail(200)
        dead_pid = first.proc.pid
        layers_tmp = Path(first.env.get("AENV_CACHE_DIR") or "/var/cache/aenv") / "layers" / "tmp"

        second = factory.start()
        assert not (layers_tmp / str(dead_pid)).exists(), "scratch of the dead server left in the layer cache"
        with api(second) as c:
            assert c.get("/templates/aliases/crashy").status_code == 404, "half-pulled template visible"
        events = _pull(second.url, image, "crashy")
        assert "template" in events[-1], events[-3:]
        sbx = Sandbox.create("crashy", timeout=120, **sdk_kwargs(second))
        try:
            out = sbx.commands.run("wc -c < /marker.bin")
            assert out.stdout.strip() == str(4 << 20)
        finally:
            sbx.kill()
        assert not leaks(factory.state_dir, {sbx.sandbox_id}, ())
    finally:
        factory.close()

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.core.templates import sandbox_image_of
from aenv.images.progress import PullEvent
from aenv.images.templates import ImageBuilder, load_image
from tests.fixtures.fakes import FakeRegistry, gz, make_tar, sha, ti


def settings(tmp: Path) -> Settings:
    return Settings(state_dir=tmp / "state", cache_dir=tmp / "cache")


def busybox_like() -> list[bytes]:
    import tarfile

    l1 = gz(
        make_tar(
            [
                (ti("bin", tarfile.DIRTYPE, 0o755), None),
                (ti("bin/sh", mode=0o755), b"#!"),
                (ti("etc", tarfile.DIRTYPE, 0o755), None),
                (ti("etc/passwd"), b"root:x:0:0::/root:/bin/sh\n"),
            ]
        )
    )
    l2 = gz(make_tar([(ti("app.txt"), b"app")]))
    return [l1, l2]


def config_for(layers: list[bytes]) -> dict:
    import gzip

    return {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": ["PATH=/bin", "X=1"], "WorkingDir": "/srv", "Cmd": ["/bin/sh", "-c", "echo hi"]},
        "rootfs": {"type": "layers", "diff_ids": [sha(gzip.decompress(la)) for la in layers]},
    }


async def test_pull_builds_template(fake_registry: FakeRegistry, tmp_path: Path) -> None:
    layers = busybox_like()
    digest = fake_registry.add_image("library/bb", "1", layers, config_for(layers))
    b = ImageBuilder(settings(tmp_path), client=fake_registry.client())
    events: list[PullEvent] = []
    tpl = await b.pull("bb:1", progress=events.append)
    assert tpl.manifest_digest == digest
    assert tpl.reference == f"docker.io/library/bb:1@{digest}"
    assert tpl.config.env["X"] == "1" and tpl.config.workdir == "/srv"
    assert tpl.start_cmd == "/bin/sh -c 'echo hi'"
    assert tpl.user_layer is not None and "user:x:1000" in (tpl.user_layer / "etc/passwd").read_text()
    assert tpl.lowers[0] == tpl.user_layer and tpl.lowers[-1] == tpl.layers[0]
    assert tpl.layers_reused == 0 and tpl.download_bytes == sum(len(la) for la in layers)
    statuses = [e.status for e in events]
    assert statuses[0] == "resolving" and statuses[-1] == "complete" and "downloading" in statuses
    assert all(json.dumps(e.to_json()) for e in events)
    assert set(b.cache.pins()) == {tpl.pin_owner}
    again = await b.pull("bb:1")
    assert again.layers_reused == 2 and again.download_bytes == 0
    assert load_image(tpl.path) is not None
    assert [t.manifest_digest for t in b.list_images()] == [digest]
    ti_ = sandbox_image_of(tpl, "tpl1")
    assert ti_.lowers == tpl.lowers and ti_.rootfs == tpl.layers[0]
    assert ti_.env["X"] == "1" and ti_.workdir == "/srv" and ti_.start_cmd == tpl.start_cmd
    assert sandbox_image_of(tpl, "t", start_cmd="srv").start_cmd == "srv"
    if os.geteuid() == 0:
        flat = await b.flat_rootfs(tpl)
        assert (flat / "app.txt").read_text() == "app" and "user:x:1000" in (flat / "etc/passwd").read_text()
    b.release_image(tpl.manifest_digest)
    assert not tpl.path.exists() and b.cache.pins() == {}
    await b.aclose()


async def test_killed_pull_leaves_no_template(fake_registry: FakeRegistry, tmp_path: Path) -> None:
    layers = busybox_like()
    fake_registry.add_image("library/bb", "1", layers, config_for(layers))
    fake_registry.gate = asyncio.Event()  # blob downloads hang until set
    b = ImageBuilder(settings(tmp_path), client=fake_registry.client())
    task = asyncio.create_task(b.pull("bb:1"))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    images = tmp_path / "cache/images"
    assert [p.name for p in images.iterdir()] == []
    assert [f for f in (tmp_path / "cache/layers/tmp").rglob("*") if not f.is_dir()] == []
    assert b.cache.pins() == {}
    fake_registry.gate.set()
    tpl = await b.pull("bb:1")  # the next attempt completes
    assert load_image(tpl.path) is not None
    await b.aclose()


async def test_concurrent_pulls_of_one_image(fake_registry: FakeRegistry, tmp_path: Path) -> None:
    layers = busybox_like()
    fake_registry.add_image("library/bb", "1", layers, config_for(layers))
    fake_registry.gate = asyncio.Event()
    b = ImageBuilder(settings(tmp_path), client=fake_registry.client())
    tasks = [asyncio.create_task(b.pull("bb:1")) for _ in range(3)]
    await asyncio.sleep(0.05)
    fake_registry.gate.set()
    tpls = await asyncio.gather(*tasks)
    assert {t.path for t in tpls} == {tpls[0].path}
    assert all(n == 1 for n in fake_registry.blob_gets.values())  # layers and config fetched once
    assert b.cache.downloads == 2
    await b.aclose()


async def test_waiter_survives_when_the_owning_pull_is_killed(
    fake_registry: FakeRegistry, tmp_path: Path
) -> None:
    layers = busybox_like()
    fake_registry.add_image("library/bb", "1", layers, config_for(layers))
    fake_registry.gate = asyncio.Event()
    b = ImageBuilder(settings(tmp_path), client=fake_registry.client())
    first = asyncio.create_task(b.pull("bb:1"))
    await asyncio.sleep(0.05)
    second = asyncio.create_task(b.pull("bb:1"))
    await asyncio.sleep(0.05)
    first.cancel()
    await asyncio.sleep(0)
    fake_registry.gate.set()
    tpl = await second
    assert load_image(tpl.path) is not None
    with pytest.raises(asyncio.CancelledError):
        await first
    await b.aclose()

"""Lazy images in an S3 store (SeaweedFS): served by a real ``aenv-lazyd``, and between two servers.

- The daemon: an ext4 published to ``s3://bucket/<prefix>`` is registered (no keys in the registration:
  the daemon has them from its environment), loop-mounted and read exactly, fetching only what is
  touched; a chunk corrupted in the bucket is EIO, never data.
- Two servers (``AENV_LAZY_IMAGES=true``, ``AENV_LAZY_STORE=s3://…``) behind a read-only registry (it
  refuses the artifact push): the first pulls the image whole and publishes its lazy artifact to S3;
  the second, with a fresh state dir, starts a sandbox on it lazily.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import obstore
import pytest

from aenv.images.lazy.lazyd import LazyDaemon, fuse_support
from aenv.images.lazy.publish import (
    LazyArtifact,
    ObjectStore,
    data_key,
    find_in_object_store,
    publish_to_object_store,
)
from aenv.testing.server import API_KEY, Server, discard_vm_state, start_server, stop_server
from tests.fixtures.lazyimage import drop_local_copy
from tests.fixtures.plugin import PushedImages
from tests.fixtures.registry import available, start_registry
from tests.fixtures.seaweedfs import SeaweedFS, seaweedfs, unique_prefix  # noqa: F401
from tests.integration.conftest import _needs_runtime
from tests.integration.test_lazy_images import SUBJECT, LoopMount, daemon, make_ext4  # noqa: F401
from tests.integration.test_lazy_sdk import push_fresh_busybox
from tests.integration.test_pull_sdk import aenv
from tests.unit.images.test_lazy_s3 import s3_env  # noqa: F401  (keys in the environment: the daemon inherits them)

pytestmark = [
    pytest.mark.skipif(fuse_support() is not None, reason=f"no FUSE here: {fuse_support()}"),
    pytest.mark.skipif(shutil.which("mkfs.ext4") is None, reason="mkfs.ext4 missing"),
]


def publish_s3(sw: SeaweedFS, img: Path, work: Path) -> tuple[ObjectStore, LazyArtifact]:
    prefix = unique_prefix("lazyd")
    store = ObjectStore(sw.store(prefix), sw.url(prefix), sw.endpoint, None)

    async def go() -> LazyArtifact:
        await publish_to_object_store(store, SUBJECT, img, work)
        found = await find_in_object_store(store, SUBJECT)
        assert found is not None
        return found

    return store, asyncio.run(go())


def test_the_daemon_serves_an_image_from_s3(
    tmp_path: Path, s3_env: SeaweedFS, daemon: LazyDaemon  # noqa: F811
) -> None:
    img, src = make_ext4(tmp_path, 64, 6)
    store, art = publish_s3(s3_env, img, tmp_path)
    daemon.ensure()
    path = daemon.register("s3a", art.index, art.source)
    reg = (daemon.root / "images" / "s3a.json").read_text()
    assert json.loads(reg)["source"]["kind"] == "s3" and s3_env.secret_access_key not in reg
    m = LoopMount(path, tmp_path / "root")
    try:
        assert (m.where / "hello.txt").read_text() == "hello from a lazy image\n"
        assert (m.where / "bin" / "f3").read_bytes() == (src / "bin" / "f3").read_bytes()
        st = daemon.stats("s3a")
        assert 0 < st["fetched"] < art.index.stored_bytes and st["max_fetches_per_chunk"] == 1
    finally:
        m.close()
    # a chunk whose bytes in the bucket are not the indexed ones: EIO, and the log says which
    raw = img.read_bytes()
    i = next(k for k, c in enumerate(art.index.chunks) if c.length > 100000)
    data = bytearray(bytes(obstore.get(store.store, data_key(SUBJECT)).bytes()))
    data[art.index.chunks[i].offset + 50] ^= 0xFF
    obstore.put(store.store, data_key(SUBJECT), bytes(data))
    bad = daemon.register("s3bad", art.index, art.source)  # its own cache: nothing of s3a's
    with open(bad, "rb") as fh:
        with pytest.raises(OSError) as exc:
            os.pread(fh.fileno(), 4096, i * art.index.chunk_size)
        assert exc.value.errno == errno.EIO
        ok = next(k for k, c in enumerate(art.index.chunks) if k != i and c.length)
        assert os.pread(fh.fileno(), 10, ok * art.index.chunk_size) == raw[ok << 20 : (ok << 20) + 10]
    assert "lazy chunk refused image=s3bad" in daemon.log_tail(20000)


def wait_key(sw: SeaweedFS, prefix: str, suffix: str, server: Server, timeout: float = 180) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        keys = sw.keys(prefix)
        if any(k.endswith(suffix) for k in keys):
            return keys
        assert time.monotonic() < deadline, f"no {suffix} in s3 under {prefix}:\n{server.log_tail()}"
        time.sleep(0.5)


def recorded_prefetch(sw: SeaweedFS, prefix: str, wait: float = 20.0) -> list[int]:
    (key,) = [k for k in sw.keys(prefix) if k.endswith("/index.json")]
    deadline = time.monotonic() + wait
    while True:
        prefetch = list(json.loads(bytes(obstore.get(sw.store(prefix), key).bytes()))["prefetch"])
        if prefetch or time.monotonic() > deadline:
            return prefetch
        time.sleep(0.2)


def finish(srv: Server) -> None:
    stop_server(srv)
    discard_vm_state(srv.state_dir)
    for root in sorted((srv.state_dir / "lazy" / "roots").glob("*")):  # the server leaves them
        subprocess.run(["umount", str(root)], check=False, capture_output=True)
    LazyDaemon(srv.state_dir / "lazy", 0).stop()


def test_a_second_server_starts_lazily_from_what_the_first_published_to_s3(
    tmp_path: Path, pushed_images: PushedImages, runtime_name: str, seaweedfs: SeaweedFS  # noqa: F811
) -> None:
    if not available():
        pytest.skip("docker-registry not installed")
    _needs_runtime(runtime_name)
    from e2b import Sandbox

    pushed_images.require("busybox:latest")
    image = push_fresh_busybox(pushed_images)
    ro = start_registry(tmp_path / "ro", data=pushed_images.registry.root / "data", readonly=True)
    prefix = unique_prefix("lazy-srv")
    env = {
        "AENV_REGISTRY_MIRRORS": f"docker.io={ro.url}",
        "AENV_POOL_SIZE": "0",
        "AENV_LAZY_IMAGES": "true",
        "AENV_LAZY_CACHE_BYTES": str(256 << 20),
        "AENV_LAZY_STORE": seaweedfs.url(prefix),
        "AENV_SNAPSHOT_STORE_ENDPOINT": seaweedfs.endpoint,
        "AENV_S3_ACCESS_KEY_ID": seaweedfs.access_key_id,
        "AENV_S3_SECRET_ACCESS_KEY": seaweedfs.secret_access_key,
    }
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    try:
        a = start_server(tmp_path / "a", runtime_name, env)
        try:
            r = aenv(a, "pull", image, "--name", "s3bb")
            assert r.returncode == 0, r.stderr
            keys = wait_key(seaweedfs, prefix, "/index.json", a)
            assert [k.rsplit("/", 1)[1] for k in keys] == ["claim", "data", "index.json"]  # claim: one converter
            log = a.log_path.read_text()
            assert "lazy publish to" in log and "refused" in log and f"published to store {seaweedfs.url(prefix)}" in log
        finally:
            finish(a)
        drop_local_copy(ro.url, image)  # the servers share a cache dir: B must not find A's whole pull
        b = start_server(tmp_path / "b", runtime_name, env)
        try:
            r = aenv(b, "pull", image, "--name", "s3bb")
            assert r.returncode == 0, r.stderr
            sbx = Sandbox.create("s3bb", api_url=b.url, sandbox_url=b.url, api_key=API_KEY)
            try:
                assert "BusyBox" in sbx.commands.run("busybox | head -1").stdout
            finally:
                sbx.kill()
            listing = json.loads(aenv(b, "cache", "ls", "-o", "json").stdout)
            (img,) = listing["lazy"]["images"]
            assert img["templates"] == ["s3bb"]
            assert 0 < img["fetched"] <= img["stored"] and img["max_fetches_per_chunk"] == 1
            reg = next((b.state_dir / "lazy" / "images").glob("*.json")).read_text()
            assert json.loads(reg)["source"]["kind"] == "s3" and seaweedfs.secret_access_key not in reg
            info = httpx.get(b.url + "/aenv/info", headers={"X-API-KEY": API_KEY}, trust_env=False).json()
            assert info["capabilities"]["lazy_images"] is True
            assert recorded_prefetch(seaweedfs, prefix)  # the first start's chunks, in the index in S3
        finally:
            finish(b)
    finally:
        ro.stop()

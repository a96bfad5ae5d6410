"""Lazy images end to end: published to a real ``docker-registry``, served by a real ``aenv-lazyd`` on FUSE.

Fast tests use a small ext4 (tens of MiB); the slow ones build a 1 GiB image and go through a
throttling proxy (1 Gbit/s, 100 Mbit/s). All skip without docker-registry, root, /dev/fuse or libfuse.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.images.lazy.lazyd import LazyDaemon, fuse_support
from aenv.images.lazy.publish import LazyArtifact, find_in_registry, publish_to_registry
from aenv.images.reference import parse_reference
from aenv.images.registry import RegistryClient
from tests.fixtures.registry import LocalRegistry, available, start_registry
from tests.fixtures.throttle import Throttle

pytestmark = [
    pytest.mark.skipif(not available(), reason="docker-registry not installed"),
    pytest.mark.skipif(fuse_support() is not None, reason=f"no FUSE here: {fuse_support()}"),
    pytest.mark.skipif(shutil.which("mkfs.ext4") is None, reason="mkfs.ext4 missing"),
]

SUBJECT = "sha256:" + "5e" * 32  # the image manifest the artifact refers to (2.8 does not check it)


def make_ext4(tmp: Path, size_mib: int, payload_mib: int) -> tuple[Path, Path]:
    """An ext4 of ``size_mib`` with ``payload_mib`` of random files (real, checkable bytes)."""
    src = tmp / "tree"
    (src / "bin").mkdir(parents=True)
    for k in range(payload_mib):
        (src / "bin" / f"f{k}").write_bytes(os.urandom(1 << 20))
    (src / "hello.txt").write_text("hello from a lazy image\n")
    img = tmp / "root.ext4"
    with open(img, "wb") as fh:
        fh.truncate(size_mib << 20)
    subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=1", "-d", str(src), str(img)], check=True
    )
    return img, src


def publish(reg: LocalRegistry, img: Path, work: Path, repo: str = "lazy/test") -> LazyArtifact:
    async def go() -> LazyArtifact:
        async with RegistryClient() as client:
            ref = parse_reference(f"{reg.host}/{repo}:1")
            await publish_to_registry(client, ref, SUBJECT, 100, img, work)
            found = await find_in_registry(client, ref, SUBJECT)  # by the fallback tag: 2.8 has no referrers
            assert found is not None
            return found

    return asyncio.run(go())


def serve(
    tmp: Path, reg: LocalRegistry, daemon: LazyDaemon, name: str, size_mib: int, payload_mib: int
) -> tuple[Path, LazyArtifact, Path]:
    """Build an ext4, publish it, start the daemon and register it: (image, artifact, lazy file)."""
    img, _ = make_ext4(tmp, size_mib, payload_mib)
    art = publish(reg, img, tmp)
    daemon.ensure()
    return img, art, daemon.register(name, art.index, art.source)


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[LocalRegistry]:
    reg = start_registry(tmp_path / "registry")
    try:
        yield reg
    finally:
        reg.stop()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[LazyDaemon]:
    d = LazyDaemon(tmp_path / "lazy", budget=1 << 30)
    try:
        yield d
    finally:
        d.stop()


class LoopMount:
    def __init__(self, image: Path, where: Path) -> None:
        where.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "ext4", "-o", "ro,noload,loop", str(image), str(where)], check=True)
        self.where = where

    def close(self) -> None:
        subprocess.run(["umount", str(self.where)], check=False)


def test_published_image_reads_exactly_and_mounts(
    tmp_path: Path, registry: LocalRegistry, daemon: LazyDaemon
) -> None:
    img, src = make_ext4(tmp_path, 64, 6)
    art = publish(registry, img, tmp_path)
    daemon.ensure()
    path = daemon.register("t1", art.index, art.source)
    m = LoopMount(path, tmp_path / "root")
    try:
        assert (m.where / "hello.txt").read_text() == "hello from a lazy image\n"
        st = daemon.stats("t1")
        assert 0 < st["fetched"] < art.index.stored_bytes  # only what the mount and one file touched
        assert (m.where / "bin" / "f3").read_bytes() == (src / "bin" / "f3").read_bytes()
    finally:
        m.close()
    assert hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(img.read_bytes()).digest()
    st = daemon.stats("t1")
    assert st["max_fetches_per_chunk"] == 1 and st["fetched"] == art.index.stored_bytes


def test_concurrent_cold_readers_fetch_each_chunk_once(
    tmp_path: Path, registry: LocalRegistry, daemon: LazyDaemon
) -> None:
    img, art, path = serve(tmp_path, registry, daemon, "t16", 32, 8)
    want = hashlib.sha256(img.read_bytes()).hexdigest()
    got: list[str] = []

    def reader() -> None:
        with open(path, "rb") as fh:
            got.append(hashlib.sha256(fh.read()).hexdigest())

    threads = [threading.Thread(target=reader) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == [want] * 16
    st = daemon.stats("t16")
    assert st["max_fetches_per_chunk"] == 1 and st["fetched"] == art.index.stored_bytes


def _registry_blob(reg: LocalRegistry, digest: str) -> Path:
    hexd = digest.split(":", 1)[1]
    return reg.root / "data/docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"


def test_a_chunk_corrupted_in_the_registry_is_refused(
    tmp_path: Path, registry: LocalRegistry, daemon: LazyDaemon
) -> None:
    img, _ = make_ext4(tmp_path, 16, 4)
    art = publish(registry, img, tmp_path)
    i = next(k for k, c in enumerate(art.index.chunks) if c.length > 100000)
    blob = _registry_blob(registry, art.index.data_digest)
    with open(blob, "r+b") as fh:
        os.pwrite(fh.fileno(), b"\xff\x00\xff", art.index.chunks[i].offset + 50)
    daemon.ensure()
    path = daemon.register("bad", art.index, art.source)
    with open(path, "rb") as fh:
        with pytest.raises(OSError) as exc:
            os.pread(fh.fileno(), 4096, i * art.index.chunk_size)
        assert exc.value.errno == errno.EIO
        ok = next(k for k, c in enumerate(art.index.chunks) if k != i and c.length)
        assert (
            os.pread(fh.fileno(), 10, ok * art.index.chunk_size)
            == img.read_bytes()[ok << 20 : (ok << 20) + 10]
        )
    assert "lazy chunk refused image=bad" in daemon.log_tail(20000)


def test_unreachable_registry_is_eio_and_logged(
    tmp_path: Path, registry: LocalRegistry, daemon: LazyDaemon
) -> None:
    img, art, path = serve(tmp_path, registry, daemon, "gone", 16, 2)
    with open(path, "rb") as fh:
        head = os.pread(fh.fileno(), 4096, 0)
        registry.stop()
        with pytest.raises(OSError) as exc:
            os.pread(fh.fileno(), 4096, 1 << 20)
    assert exc.value.errno == errno.EIO and head == img.read_bytes()[:4096]
    assert "lazy fetch failed image=gone" in daemon.log_tail(20000)


def test_a_killed_reader_comes_back_without_a_corrupt_cache(
    tmp_path: Path, registry: LocalRegistry, daemon: LazyDaemon
) -> None:
    img, art, path = serve(tmp_path, registry, daemon, "k", 48, 24)
    done = threading.Event()

    def read_all() -> None:
        try:
            path.read_bytes()
        except OSError:
            pass
        done.set()

    t = threading.Thread(target=read_all)
    t.start()
    time.sleep(0.15)
    pid = daemon.pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)  # mid-read
    t.join(30)
    assert not daemon.alive()
    daemon.ensure()  # detaches the dead mount, adopts the cache
    assert hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(img.read_bytes()).digest()


def test_pin_fetches_everything_and_survives_the_registry(
    tmp_path: Path, registry: LocalRegistry, daemon: LazyDaemon
) -> None:
    img, art, path = serve(tmp_path, registry, daemon, "p", 16, 3)
    daemon.pin("p")
    st = daemon.stats("p")
    assert st["pinned"] and st["cached"] >= art.index.stored_bytes // 2
    registry.stop()
    assert path.read_bytes() == img.read_bytes()  # offline: every chunk is local


# -- slow: 1 GiB images behind a throttled registry -------------------------------------------------


def big_image(tmp: Path) -> tuple[Path, Path]:
    """A 1 GiB ext4 holding 600 MiB of random files (real bytes, checked by sha256 below)."""
    return make_ext4(tmp, 1024, 600)


@pytest.mark.slow
@pytest.mark.parametrize("bits_per_s", [1e9, 1e8], ids=["1Gbit", "100Mbit"])
def test_one_gib_image_fetches_only_what_it_touches(
    tmp_path: Path, registry: LocalRegistry, daemon: LazyDaemon, bits_per_s: float
) -> None:
    img, src = big_image(tmp_path)
    art = publish(registry, img, tmp_path)
    thr = Throttle(
        int(registry.host.rsplit(":", 1)[1]), bits_per_s=bits_per_s, rtt=0.001 if bits_per_s >= 1e9 else 0.01
    )
    try:
        source = {**art.source, "reference": f"127.0.0.1:{thr.port}/lazy/test"}
        daemon.ensure()
        path = daemon.register("big", art.index, source)
        m = LoopMount(path, tmp_path / "root")
        try:
            assert (m.where / "hello.txt").read_text() == "hello from a lazy image\n"
            assert (m.where / "bin" / "f7").read_bytes() == (src / "bin" / "f7").read_bytes()
        finally:
            m.close()
        st = daemon.stats("big")
        assert st["fetched"] < art.index.stored_bytes // 20  # a few MiB of ~600
        assert thr.bytes < art.index.stored_bytes // 20 + (1 << 20)
        assert st["disk"] <= 2 * st["cached"] + (1 << 20)
    finally:
        thr.close()


@pytest.mark.slow
def test_three_gib_images_run_side_by_side_under_a_512_mib_budget(
    tmp_path: Path, registry: LocalRegistry
) -> None:
    img, src = big_image(tmp_path)
    art = publish(registry, img, tmp_path)
    d = LazyDaemon(tmp_path / "lazy512", budget=512 << 20)
    mounts: list[LoopMount] = []
    try:
        d.ensure()
        for k in range(3):  # three images (three names: three caches' worth of chunks) on one budget
            mounts.append(LoopMount(d.register(f"img{k}", art.index, art.source), tmp_path / f"root{k}"))
        want = {
            f: hashlib.sha256((src / "bin" / f).read_bytes()).hexdigest()
            for f in (f"f{i}" for i in range(0, 600, 3))
        }
        for m in mounts:  # 200 MiB of each: 600 MiB of working set in all, over the budget
            for f, h in want.items():
                assert hashlib.sha256((m.where / "bin" / f).read_bytes()).hexdigest() == h
        mounts[0].close()  # the first again, remounted, after the others evicted much of it: still exact
        mounts[0] = LoopMount(d.path_of("img0"), tmp_path / "root0")
        for f, h in list(want.items())[:50]:
            assert hashlib.sha256((mounts[0].where / "bin" / f).read_bytes()).hexdigest() == h
        st = d.stats("img0")
        assert st["evictions"] > 0 and st["cache_unpinned_bytes"] <= 512 << 20
        disk = sum(os.stat(p).st_blocks * 512 for p in (tmp_path / "lazy512" / "cache").glob("*.cache"))
        assert disk <= (512 << 20) + (8 << 20)
    finally:
        for m in mounts:
            m.close()
        d.stop()

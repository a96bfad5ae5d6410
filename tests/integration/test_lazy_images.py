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

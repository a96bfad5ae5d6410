"""The archive ``docker load`` reads, written from the node's blob cache (images/docker_archive.py)."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest
import zstandard

from aenv.images import docker_archive as da
from aenv.images.cache import LayerCache
from aenv.images.errors import DigestMismatch
from aenv.images.reference import parse_reference
from tests.fixtures.fakes import FakeRegistry, make_tar, sha, ti


def config_for(*plain_layers: bytes) -> dict[str, object]:
    return {"architecture": "amd64", "os": "linux", "config": {"Cmd": ["sh"]},
            "rootfs": {"type": "layers", "diff_ids": [sha(t) for t in plain_layers]}}


def layer(name: str, payload: bytes) -> tuple[bytes, bytes]:
    """(plain tar, its gzip)."""
    import gzip

    plain = make_tar([(ti(name), payload)])
    return plain, gzip.compress(plain, mtime=0)


async def write(images: list[da.ArchiveImage]) -> bytes:
    files = da.members(images)
    out = b"".join([chunk async for chunk in da.archive_chunks(files, chunk=7)])
    assert len(out) == da.archive_size(files)
    return out


async def test_two_images_sharing_a_layer_make_one_archive_with_that_layer_once(
        fake_registry: FakeRegistry, tmp_path: Path) -> None:
    base_plain, base = layer("base", b"b" * 3000)
    app_plain, app = layer("app", b"a" * 10)
    fake_registry.add_image("library/base", "1", [base], config_for(base_plain))
    fake_registry.add_image("aenv/app", "2", [base, app], config_for(base_plain, app_plain))
    cache = LayerCache(tmp_path / "cache", 10**9)
    client = fake_registry.client()
    try:
        one = await da.fetch_image(client, cache, "base:1", "docker.io/library/base:1", "pull:1:a")
        two = await da.fetch_image(client, cache, "aenv/app:2", "docker.io/aenv/app:2", "pull:1:a")
    finally:
        await client.aclose()
    assert fake_registry.blob_gets[sha(base)] == 1  # the cache served the second image's base layer
    assert set(cache.pins("pull:1:a")["pull:1:a"]) == {sha(base), sha(app)}
    raw = await write([one, two])
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        names = tar.getnames()
        manifest = json.loads(tar.extractfile("manifest.json").read())  # type: ignore[union-attr]
        files = {n: tar.extractfile(n).read() for n in names if n.endswith(".tar")}  # type: ignore[union-attr]
        configs = {n: json.loads(tar.extractfile(n).read()) for n in names if n.endswith(".json") and "/" not in n  # type: ignore[union-attr]
                   and n != "manifest.json"}
    assert len(names) == len(set(names)) == 5  # manifest, 2 configs, 2 layers
    assert [m["RepoTags"] for m in manifest] == [["docker.io/library/base:1"], ["docker.io/aenv/app:2"]]
    assert manifest[1]["Layers"][0] == manifest[0]["Layers"][0] == sha(base).split(":")[1] + "/layer.tar"
    assert files[manifest[1]["Layers"][0]] == base and files[manifest[1]["Layers"][1]] == app  # gzip as stored
    assert configs[manifest[1]["Config"]]["rootfs"]["diff_ids"] == [sha(base_plain), sha(app_plain)]


async def test_a_zstd_layer_goes_in_decompressed_and_checked(fake_registry: FakeRegistry, tmp_path: Path) -> None:
    plain = make_tar([(ti("z"), b"z" * 5000)])
    blob = zstandard.ZstdCompressor().compress(plain)
    fake_registry.add_image("library/z", "1", [blob], config_for(plain),
                            media="application/vnd.oci.image.layer.v1.tar+zstd")
    cache = LayerCache(tmp_path / "cache", 10**9)
    client = fake_registry.client()
    try:
        image = await da.fetch_image(client, cache, "z:1", "docker.io/library/z:1", "pull:1:z")
        assert image.layers[0].read_bytes() == plain
        assert image.layers[0] == cache.blob_path(sha(plain))  # kept under its diff_id
        assert set(image.digests) == {sha(blob), sha(plain)}
        bad = {"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": ["sha256:" + "0" * 64]}}
        fake_registry.add_image("library/bad", "1", [zstandard.ZstdCompressor().compress(plain + b"\0" * 512)], bad,
                                media="application/vnd.oci.image.layer.v1.tar+zstd")
        with pytest.raises(DigestMismatch):
            await da.fetch_image(client, cache, "bad:1", "docker.io/library/bad:1", "pull:1:z")
        assert not cache.has_blob("sha256:" + "0" * 64)
    finally:
        await client.aclose()


async def test_blobs_are_fetched_once_for_concurrent_callers_and_evicted_only_unpinned(
        fake_registry: FakeRegistry, tmp_path: Path) -> None:
    _, big = layer("big", bytes(range(256)) * 40)
    fake_registry.add_image("library/big", "1", [big])
    fake_registry.gate = asyncio.Event()
    cache = LayerCache(tmp_path / "cache", 10**9)
    client = fake_registry.client()
    try:
        resolved = await client.resolve(parse_reference("big:1"))
        desc = resolved.manifest.layers[0]
        tasks = [asyncio.create_task(cache.ensure_blob(client, resolved.reference, desc)) for _ in range(4)]
        await asyncio.sleep(0.05)  # every task reaches the shared download (no timing is asserted)
        fake_registry.gate.set()
        paths = await asyncio.gather(*tasks)
    finally:
        await client.aclose()
    assert len(set(paths)) == 1 and fake_registry.blob_gets[desc.digest] == 1
    assert hashlib.sha256(paths[0].read_bytes()).hexdigest() == desc.digest.split(":")[1]
    cache.pin("pull:1:p", [desc.digest])
    cache.budget = 1
    assert cache.evict() == [] and paths[0].exists()
    cache.unpin("pull:1:p")
    assert [e.digest for e in cache.evict()] == [desc.digest] and not paths[0].exists()


async def test_the_archive_streams_files_it_does_not_hold_in_memory(tmp_path: Path) -> None:
    blob = tmp_path / ("ab" * 32)
    blob.write_bytes(b"L" * 1500)
    image = da.ArchiveImage(("x:1",), b'{"rootfs": {}}', (blob,))
    raw = await write([image])
    assert len(raw) % 512 == 0 and raw.endswith(b"\0" * 1024)
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        assert tar.extractfile(f"{'ab' * 32}/layer.tar").read() == b"L" * 1500  # type: ignore[union-attr]
    blob.write_bytes(b"short")  # the file changed under the writer: an error, never a bad tar
    files = da.members([image])
    blob.write_bytes(b"")
    with pytest.raises(OSError, match="shorter"):
        async for _ in da.archive_chunks(files):
            pass

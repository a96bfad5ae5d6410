"""Lazy images in an S3 store (SeaweedFS ``weed mini``): published, found, read through ``LazyReader``.

The reader's s3 source builds its store from the source JSON (URL, endpoint, region) and the
environment's keys, as ``aenv-lazyd`` does: the registration holds no secret. A chunk whose bytes
in the bucket are not the indexed ones is refused (sha256), never served.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import obstore
import pytest

from aenv.config import Settings
from aenv.images.lazy import publish as pub
from aenv.images.lazy import reader as rd
from aenv.images.lazy.chunkcache import ChunkCache
from aenv.images.lazy.reader import ChunkError, LazyReader, source_of
from aenv.images.lazy.service import store_of
from aenv.images.registry import RegistryClient
from tests.fixtures.seaweedfs import SeaweedFS, seaweedfs, unique_prefix  # noqa: F401

CS = 1 << 20  # the default chunk size
DIGEST = "sha256:" + "ab" * 32


@pytest.fixture
def s3_env(seaweedfs: SeaweedFS, monkeypatch: pytest.MonkeyPatch) -> SeaweedFS:  # noqa: F811
    """The keys only in the environment (the server's and the daemon's); stores built afresh."""
    monkeypatch.setenv("AENV_S3_ACCESS_KEY_ID", seaweedfs.access_key_id)
    monkeypatch.setenv("AENV_S3_SECRET_ACCESS_KEY", seaweedfs.secret_access_key)
    monkeypatch.setattr(rd, "_stores", {})
    return seaweedfs


def image(tmp_path: Path) -> bytes:
    """An image with data, a hole (zero chunks) and data again, not a whole number of chunks: its data
    object (~9 MiB, incompressible) goes up as a multipart upload of two parts."""
    raw = os.urandom(6 * CS) + bytes(4 * CS) + os.urandom(3 * CS - 77)
    (tmp_path / "img").write_bytes(raw)
    return raw


def settings(tmp_path: Path, sw: SeaweedFS, prefix: str) -> Settings:
    return Settings(state_dir=tmp_path / "s", cache_dir=tmp_path / "c", lazy_store=sw.url(prefix),
                    snapshot_store_endpoint=sw.endpoint)  # fmt: skip


async def published(tmp_path: Path, sw: SeaweedFS, tag: str) -> tuple[pub.ObjectStore, pub.LazyArtifact]:
    image(tmp_path)
    store = store_of(settings(tmp_path, sw, unique_prefix(tag)))
    assert isinstance(store, pub.ObjectStore)
    (tmp_path / "work").mkdir()
    return store, await pub.publish_to_object_store(store, DIGEST, tmp_path / "img", tmp_path / "work")


async def test_publish_find_and_read_through_s3(tmp_path: Path, s3_env: SeaweedFS) -> None:
    raw = image(tmp_path)
    prefix = unique_prefix("lazy")
    store = store_of(settings(tmp_path, s3_env, prefix))
    assert isinstance(store, pub.ObjectStore)
    assert await pub.find_in_object_store(store, DIGEST) is None
    work = tmp_path / "work"
    work.mkdir()
    art = await pub.publish_to_object_store(store, DIGEST, tmp_path / "img", work)
    hexd = DIGEST.split(":")[1]
    assert s3_env.keys(prefix) == [f"lazy/{hexd}/data", f"lazy/{hexd}/index.json"]
    assert not list(work.iterdir())  # the chunked data is not left behind
    found = await pub.find_in_object_store(store, DIGEST)
    assert found is not None and found.index == art.index and found.source == art.source
    # what aenv-lazyd gets in DIR/images/<name>.json: where, never how to sign in
    text = json.dumps(found.source)
    assert found.source["kind"] == "s3" and s3_env.secret_access_key not in text
    assert s3_env.access_key_id not in text
    async with RegistryClient() as client:
        reader = LazyReader(ChunkCache(tmp_path / "cache", 1 << 30))
        reader.add("img", found.index, source_of(found.source, client))
        assert await reader.read("img", 0, len(raw)) == raw
        assert await reader.read("img", 5 * CS + 5, 2 * CS) == raw[5 * CS + 5 : 7 * CS + 5]
        assert reader.counters.requests >= 1 and reader.counters.errors == 0
        assert reader.counters.fetched_bytes == found.index.stored_bytes  # zero chunks are not fetched
        await reader.aclose()


async def test_a_corrupted_data_object_is_refused(tmp_path: Path, s3_env: SeaweedFS) -> None:
    store, art = await published(tmp_path, s3_env, "lazy-bad")
    key = pub.data_key(DIGEST)
    data = bytearray(bytes(obstore.get(store.store, key).bytes()))
    c = art.index.chunks[1]
    data[c.offset + 3] ^= 0xFF
    obstore.put(store.store, key, bytes(data))
    async with RegistryClient() as client:
        reader = LazyReader(ChunkCache(tmp_path / "cache", 1 << 30))
        reader.add("img", art.index, source_of(art.source, client))
        with pytest.raises(ChunkError, match="sha256"):
            await reader.read("img", CS, 10)
        assert not reader.cache.has("img", 1)
        assert len(await reader.read("img", 0, 10)) == 10  # its neighbour is fine
        await reader.aclose()


async def test_no_keys_or_store_down_is_an_error_not_data(
    tmp_path: Path, s3_env: SeaweedFS, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, art = await published(tmp_path, s3_env, "lazy-down")
    monkeypatch.setenv("AENV_S3_SECRET_ACCESS_KEY", "wrong")
    monkeypatch.setattr(rd, "_stores", {})
    gone = dict(art.source, endpoint="http://127.0.0.1:9")  # nothing listens on the discard port
    async with RegistryClient() as client:
        for src in (art.source, gone):
            reader = LazyReader(ChunkCache(tmp_path / f"cache-{len(rd._stores)}", 1 << 30))
            reader.add("img", art.index, source_of(src, client))
            with pytest.raises(ChunkError):
                await reader.read("img", 0, 10)
            await reader.aclose()


def test_lazy_store_urls(tmp_path: Path) -> None:
    s = Settings(state_dir=tmp_path / "s", cache_dir=tmp_path / "c")
    assert store_of(s) == tmp_path / "s" / "lazy-store"
    assert store_of(s.model_copy(update={"lazy_store": "/srv/lazy"})) == Path("/srv/lazy")
    assert store_of(Settings(state_dir=tmp_path, lazy_store="file:///srv/x")) == Path("/srv/x")
    for bad in ("s3://", "s3://key:secret@bucket/p", "gs://bucket"):
        with pytest.raises(ValueError):
            Settings(state_dir=tmp_path, lazy_store=bad)


def test_an_s3_lazy_store_takes_the_snapshot_stores_endpoint_and_region(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://env-endpoint:9000")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    monkeypatch.setenv("AENV_S3_SECRET_ACCESS_KEY", "s3cr3t")
    s = Settings(state_dir=tmp_path, lazy_store="s3://bkt/pre/fix")
    store = store_of(s)
    assert isinstance(store, pub.ObjectStore)
    assert (store.url, store.endpoint, store.region) == ("s3://bkt/pre/fix", "http://env-endpoint:9000", "eu-west-3")
    store = store_of(s.model_copy(update={"snapshot_store_endpoint": "http://mine:8333", "snapshot_store_region": "r1"}))
    assert isinstance(store, pub.ObjectStore) and (store.endpoint, store.region) == ("http://mine:8333", "r1")
    src = store.source(DIGEST)
    assert src == {"kind": "s3", "url": "s3://bkt/pre/fix", "key": f"lazy/{DIGEST[7:]}/data",
                   "endpoint": "http://mine:8333", "region": "r1"}  # fmt: skip
    assert "s3cr3t" not in json.dumps(src)


async def test_a_store_that_is_down_means_a_full_pull_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from aenv.images.lazy.service import LazyImages
    from aenv.images.reference import parse_reference

    async def no_artifact(*_a: object) -> None:
        return None

    monkeypatch.setattr(pub, "find_in_registry", no_artifact)
    s = Settings(state_dir=tmp_path / "s", cache_dir=tmp_path / "c", lazy_store="s3://bkt/p",
                 snapshot_store_endpoint="http://127.0.0.1:9")  # fmt: skip
    async with RegistryClient() as client:
        lazy = LazyImages(s, client)
        assert lazy.store_name == "s3://bkt/p"
        with caplog.at_level("WARNING", "aenv.lazy"):
            assert await lazy.find(parse_reference("example.org/x:1"), DIGEST) is None
    assert "lazy artifact lookup in s3://bkt/p failed" in caplog.text

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest

from aenv.images.cache import LayerCache
from aenv.images.errors import DigestMismatch
from aenv.images.reference import parse_reference
from tests.fixtures.fakes import FakeRegistry, layer_with, sha


def clock() -> itertools.count[int]:
    return itertools.count(1000)


def make_cache(root: Path, budget: int = 10**9) -> LayerCache:
    c = clock()
    return LayerCache(root, budget, clock=lambda: float(next(c)))


async def resolve(fake: FakeRegistry, name: str):  # type: ignore[no-untyped-def]
    client = fake.client()
    return client, await client.resolve(parse_reference(name))


async def test_layer_stored_once_and_reused(fake_registry: FakeRegistry, tmp_path: Path) -> None:
    shared = layer_with("shared", b"s" * 1000)
    fake_registry.add_image("library/a", "1", [shared, layer_with("a", b"a")])
    fake_registry.add_image("library/b", "1", [shared, layer_with("b", b"b")])
    cache = make_cache(tmp_path / "layers")
    client = fake_registry.client()
    for name in ("a:1", "b:1"):
        r = await client.resolve(parse_reference(name))
        infos = [await cache.ensure_layer(client, r.reference, d) for d in r.manifest.layers]
        assert all(i.path.is_dir() for i in infos)
    assert fake_registry.blob_gets[sha(shared)] == 1
    assert cache.downloads == 3 and cache.usage().entries == 3
    await client.aclose()


async def test_concurrent_pulls_share_one_download(fake_registry: FakeRegistry, tmp_path: Path) -> None:
    layer = layer_with("big", b"z" * 10000)
    fake_registry.add_image("library/a", "1", [layer])
    fake_registry.gate = asyncio.Event()
    cache = make_cache(tmp_path / "layers")
    client, r = await resolve(fake_registry, "a:1")
    desc = r.manifest.layers[0]
    tasks = [asyncio.create_task(cache.ensure_layer(client, r.reference, desc)) for _ in range(5)]
    await asyncio.sleep(0.05)  # let every task reach the shared future (no timing is asserted)
    fake_registry.gate.set()
    infos = await asyncio.gather(*tasks)
    assert fake_registry.blob_gets[desc.digest] == 1 and cache.downloads == 1
    assert len({i.path for i in infos}) == 1 and sum(not i.reused for i in infos) == 1
    await client.aclose()


async def test_digest_mismatch_never_cached(fake_registry: FakeRegistry, tmp_path: Path) -> None:
    layer = layer_with("f", b"q" * 500)
    fake_registry.add_image("library/a", "1", [layer])
    fake_registry.corrupt.add(sha(layer))
    cache = make_cache(tmp_path / "layers")
    client, r = await resolve(fake_registry, "a:1")
    with pytest.raises(DigestMismatch):
        await cache.ensure_layer(client, r.reference, r.manifest.layers[0])
    assert not cache.has_layer(sha(layer)) and cache.usage().entries == 0
    assert [f for f in (tmp_path / "layers/tmp").rglob("*") if not f.is_dir()] == []
    assert list((tmp_path / "layers/unpacked").iterdir()) == []
    fake_registry.corrupt.clear()  # the next pull downloads again and succeeds
    info = await cache.ensure_layer(client, r.reference, r.manifest.layers[0])
    assert not info.reused and cache.has_layer(sha(layer))
    await client.aclose()


async def test_budget_lru_and_pins(fake_registry: FakeRegistry, tmp_path: Path) -> None:
    layers = [layer_with(f"f{i}", bytes([i]) * 4000) for i in range(4)]
    for i, la in enumerate(layers):
        fake_registry.add_image("library/img", str(i), [la])
    cache = make_cache(tmp_path / "layers")
    client = fake_registry.client()
    digests = []
    for i in range(3):
        r = await client.resolve(parse_reference(f"img:{i}"))
        await cache.ensure_layer(client, r.reference, r.manifest.layers[0])
        digests.append(r.manifest.layers[0].digest)
    cache.budget = 3 * cache.entries()[0].size  # room for exactly three layers
    cache.pin("template:t0", [digests[0]])  # oldest, but in use
    cache.touch([digests[1]])  # 2 is now least recently used among the unpinned
    r = await client.resolve(parse_reference("img:3"))
    await cache.ensure_layer(client, r.reference, r.manifest.layers[0])
    assert cache.has_layer(digests[0])  # pinned survives although oldest
    assert cache.has_layer(digests[1])  # recently touched
    assert not cache.has_layer(digests[2])  # LRU unpinned evicted
    assert cache.usage().used <= cache.budget
    # everything pinned: the cache goes over budget rather than break users
    cache.pin("sandbox:s", [d.digest for d in r.manifest.layers] + digests[:2])
    assert cache.evict(need_bytes=10**6) == []
    cache.unpin("sandbox:s")
    cache.unpin("template:t0")
    removed = cache.prune(everything_unpinned=True)
    assert len(removed) == 3 and cache.usage().entries == 0
    await client.aclose()


async def test_recover_after_crash(fake_registry: FakeRegistry, tmp_path: Path) -> None:
    root = tmp_path / "layers"
    layer = layer_with("f", b"r")
    fake_registry.add_image("library/a", "1", [layer])
    cache = make_cache(root)
    client, r = await resolve(fake_registry, "a:1")
    await cache.ensure_layer(client, r.reference, r.manifest.layers[0])
    cache.pin("pull:999999999:x", [sha(layer)])
    cache.pin("template:x", [sha(layer)])
    cache.close()
    # simulate a crash: a half download, an orphan layer dir renamed but never indexed
    (root / "tmp/999999999").mkdir()
    (root / "tmp/999999999/blob-123").write_bytes(b"partial")
    (root / "unpacked" / ("e" * 64)).mkdir()
    cache2 = make_cache(root)
    assert [f for f in (root / "tmp").rglob("*") if not f.is_dir()] == []
    assert not (root / "unpacked" / ("e" * 64)).exists()
    assert cache2.has_layer(sha(layer))
    assert set(cache2.pins()) == {"template:x"}  # pull pins of the dead process dropped
    # an indexed layer whose dir vanished is forgotten
    import shutil

    shutil.rmtree(cache2.layer_path(sha(layer)))
    cache2.close()
    assert make_cache(root).usage().entries == 0
    await client.aclose()


async def test_disk_full_is_a_cache_error_and_leaves_nothing(
    fake_registry: FakeRegistry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from aenv.images import cache as cache_mod
    from aenv.images.errors import CacheError

    def full(*a: object, **k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    layer = layer_with("f", b"d" * 300)
    fake_registry.add_image("library/a", "1", [layer])
    cache = make_cache(tmp_path / "layers")
    client, r = await resolve(fake_registry, "a:1")
    monkeypatch.setattr(cache_mod, "unpack_layer", full)
    with pytest.raises(CacheError, match="disk full") as e:
        await cache.ensure_layer(client, r.reference, r.manifest.layers[0])
    assert "docker.io/library/a:1" in str(e.value)
    assert cache.usage().entries == 0
    assert [f for f in (tmp_path / "layers/tmp").rglob("*") if not f.is_dir()] == []
    await client.aclose()

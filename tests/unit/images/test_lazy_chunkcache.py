"""The chunk cache: one global budget, LRU by punched holes, pins, and a restart that never serves bad bytes."""

from __future__ import annotations

import os
from pathlib import Path

from aenv.images.lazy.chunkcache import ChunkCache

CS = 64 << 10


def chunk(n: int) -> bytes:
    return bytes([n % 251 + 1]) * CS


def test_budget_evicts_least_recently_used_across_images(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, budget=4 * CS)
    cache.add_image("a", 16 * CS, CS)
    cache.add_image("b", 16 * CS, CS)
    for i in range(3):
        cache.put("a", i, chunk(i))
    assert cache.get("a", 0) == chunk(0)  # a/0 is now the most recent
    cache.put("b", 0, chunk(10))
    cache.put("b", 1, chunk(11))  # over budget: a/1 (least recent) goes
    assert not cache.has("a", 1) and cache.has("a", 0) and cache.has("b", 1)
    assert cache.unpinned_bytes <= 4 * CS
    usage = {u.name: u for u in cache.usage()}
    assert usage["a"].cached + usage["b"].cached == 4 * CS
    assert usage["a"].disk <= 2 * CS + 8192  # the hole was punched
    cache.close()


def test_pinned_images_are_kept_and_not_counted(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, budget=2 * CS)
    cache.add_image("p", 8 * CS, CS)
    cache.add_image("q", 8 * CS, CS)
    cache.set_pinned("p", True)
    for i in range(4):
        cache.put("p", i, chunk(i))
    for i in range(4):
        cache.put("q", i, chunk(i))
    assert all(cache.has("p", i) for i in range(4))
    assert sum(cache.has("q", i) for i in range(4)) == 2
    cache.set_pinned("p", False)  # now it counts: the oldest chunks go
    assert cache.unpinned_bytes <= 2 * CS
    cache.close()


def test_restart_keeps_good_chunks_and_drops_a_damaged_one(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, budget=1 << 30)
    cache.add_image("a", 4 * CS, CS)
    cache.put("a", 0, chunk(1))
    cache.put("a", 2, chunk(2))
    cache.close()
    with open(tmp_path / "a.cache", "r+b") as fh:  # bytes lost or damaged behind the cache's back
        os.pwrite(fh.fileno(), b"\0" * 10, 2 * CS + 5)
    again = ChunkCache(tmp_path, budget=1 << 30)
    again.add_image("a", 4 * CS, CS)
    assert again.get("a", 0) == chunk(1)
    assert again.get("a", 2) is None and not again.has("a", 2)
    again.close()


def test_a_new_chunk_size_drops_the_old_chunks(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, budget=1 << 30)
    cache.add_image("a", 4 * CS, CS)
    cache.put("a", 0, chunk(1))
    cache.close()
    again = ChunkCache(tmp_path, budget=1 << 30)
    again.add_image("a", 4 * CS, 2 * CS)
    assert not again.has("a", 0)
    again.close()

"""The reader: single-flight and coalesced fetches, checked chunks, errors that are never data."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from aenv.images.lazy.chunkcache import ChunkCache
from aenv.images.lazy.format import LazyIndex, chunkify
from aenv.images.lazy.reader import ChunkError, LazyReader

CS = 64 << 10


class FakeSource:
    """The data blob in memory, counting requests; ``fail``/``corrupt`` simulate a bad registry."""

    def __init__(self, data: bytes) -> None:
        self.data = bytearray(data)
        self.requests: list[tuple[int, int]] = []
        self.fail = False
        self.gate: asyncio.Event | None = None

    async def fetch(self, start: int, end: int) -> bytes:
        self.requests.append((start, end))
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise ConnectionError("registry unreachable")
        return bytes(self.data[start:end])

    async def aclose(self) -> None:
        return None


def build(tmp_path: Path, nchunks: int = 12) -> tuple[bytes, LazyIndex, FakeSource]:
    raw = os.urandom(nchunks * CS - 100)
    (tmp_path / "img").write_bytes(raw)
    index = chunkify(tmp_path / "img", tmp_path / "data", chunk_size=CS)
    return raw, index, FakeSource((tmp_path / "data").read_bytes())


async def test_reads_are_exact_and_misses_are_coalesced(tmp_path: Path) -> None:
    raw, index, src = build(tmp_path)
    reader = LazyReader(ChunkCache(tmp_path / "c", 1 << 30))
    reader.add("img", index, src)
    assert await reader.read("img", 100, 3 * CS) == raw[100 : 100 + 3 * CS]
    assert len(src.requests) == 1  # four adjacent chunks, one Range request
    assert await reader.read("img", 100, 3 * CS) == raw[100 : 100 + 3 * CS]
    assert len(src.requests) == 1  # cached
    assert await reader.read("img", len(raw) - 10, 1000) == raw[-10:]
    assert reader.touched("img")[:4] == [0, 1, 2, 3]


async def test_sixteen_concurrent_cold_readers_fetch_each_chunk_once(tmp_path: Path) -> None:
    raw, index, src = build(tmp_path)
    src.gate = asyncio.Event()
    reader = LazyReader(ChunkCache(tmp_path / "c", 1 << 30))
    reader.add("img", index, src)
    tasks = [asyncio.create_task(reader.read("img", (k % 4) * CS, 8 * CS)) for k in range(16)]
    await asyncio.sleep(0.05)
    src.gate.set()
    out = await asyncio.gather(*tasks)
    assert all(o == raw[(k % 4) * CS : (k % 4) * CS + 8 * CS] for k, o in enumerate(out))
    assert max(reader.counters.per_chunk.values()) == 1
    assert reader.counters.fetched_bytes == sum(c.length for c in index.chunks[:11])


async def test_unreachable_source_is_an_error_then_recovers(tmp_path: Path) -> None:
    raw, index, src = build(tmp_path)
    reader = LazyReader(ChunkCache(tmp_path / "c", 1 << 30))
    reader.add("img", index, src)
    src.fail = True
    with pytest.raises(ChunkError, match="unreachable"):
        await reader.read("img", 0, 10)
    src.fail = False
    assert await reader.read("img", 0, 10) == raw[:10]


async def test_a_corrupted_chunk_in_the_source_is_refused(tmp_path: Path) -> None:
    raw, index, src = build(tmp_path)
    c = index.chunks[2]
    src.data[c.offset + 7] ^= 0xFF
    reader = LazyReader(ChunkCache(tmp_path / "c", 1 << 30))
    reader.add("img", index, src)
    with pytest.raises(ChunkError, match="sha256"):
        await reader.read("img", 2 * CS, 10)
    assert not reader.cache.has("img", 2)
    assert await reader.read("img", CS, 10) == raw[CS : CS + 10]  # its neighbours are fine


async def test_reads_stay_exact_under_a_budget_smaller_than_the_data(tmp_path: Path) -> None:
    raw, index, src = build(tmp_path)
    reader = LazyReader(ChunkCache(tmp_path / "c", 3 * CS))
    reader.add("img", index, src)
    for _ in range(2):
        for off in range(0, len(raw), 5 * CS // 2):
            assert await reader.read("img", off, 2 * CS) == raw[off : off + 2 * CS]
    assert reader.cache.unpinned_bytes <= 3 * CS
    assert reader.cache.evictions > 0


async def test_prefetch_replays_the_list(tmp_path: Path) -> None:
    _, index, src = build(tmp_path)
    reader = LazyReader(ChunkCache(tmp_path / "c", 1 << 30))
    reader.add("img", index.with_prefetch([7, 3, 4]), src)
    assert await reader.prefetch("img") == 3
    assert all(reader.cache.has("img", i) for i in (3, 4, 7))
    assert len(src.requests) == 2  # 3+4 coalesced, 7 alone


async def test_a_miss_queued_while_a_fetch_runs_is_fetched_too(tmp_path: Path) -> None:
    """A read that misses while an earlier fetch is in flight (a loop device's read-ahead behind a read)
    gets its own fetch: it never waits for a later read to kick it."""
    raw, index, src = build(tmp_path)
    src.gate = asyncio.Event()
    reader = LazyReader(ChunkCache(tmp_path / "c", 1 << 30))
    reader.add("img", index, src)
    first = asyncio.create_task(reader.read("img", 0, CS))
    while not src.requests:  # the first fetch is in flight, held at the gate
        await asyncio.sleep(0.001)
    second = asyncio.create_task(reader.read("img", 8 * CS, CS))
    while len(src.requests) < 2:  # fetched although the first has not finished
        await asyncio.sleep(0.001)
    src.gate.set()
    assert await asyncio.wait_for(first, 5) == raw[:CS] and await asyncio.wait_for(second, 5) == raw[8 * CS : 9 * CS]
    await reader.aclose()

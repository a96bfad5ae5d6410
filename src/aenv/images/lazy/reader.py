"""The on-demand reader: chunks of lazy images, from the chunk cache or fetched, never wrong bytes.

``LazyReader`` runs on one asyncio loop. A read names an image and a byte range; each chunk it
touches is taken from the ``ChunkCache`` or fetched from the image's source:

- **single flight**: concurrent misses of one chunk share one fetch (16 cold sandboxes fetch it once);
- **coalesced, parallel**: missing chunks next to each other go in one Range request (up to
  ``max_run`` bytes), at most ``parallel`` requests at a time;
- **checked**: every chunk's sha256 and size before it is decompressed or cached; a mismatch is a
  ``ChunkError`` (the FUSE layer answers EIO and the log names the image and chunk), never data;
- **prefetch**: ``prefetch(name)`` replays the index's list of chunks a first start touched.

Sources are small: ``RegistrySource`` (HTTP Range on the data blob), ``DirSource`` (pread) and
``S3Source`` (a ranged GET on an object store's data object).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from aenv.images.lazy.chunkcache import ChunkCache
from aenv.images.lazy.format import LazyFormatError, LazyIndex, decode_chunk
from aenv.images.reference import parse_reference
from aenv.images.registry import RegistryClient

log = logging.getLogger("aenv.lazy")

MAX_RUN = 8 << 20  # compressed bytes in one Range request
PARALLEL = 8


class ChunkError(Exception):
    """A chunk could not be served: its source failed, or its bytes were not the ones indexed."""


class Source(Protocol):
    async def fetch(self, start: int, end: int) -> bytes: ...

    async def aclose(self) -> None: ...


class DirSource:
    def __init__(self, path: str) -> None:
        self.path = path

    async def fetch(self, start: int, end: int) -> bytes:
        def read() -> bytes:
            with open(self.path, "rb") as fh:
                return os.pread(fh.fileno(), end - start, start)

        return await asyncio.to_thread(read)

    async def aclose(self) -> None:
        return None


class RegistrySource:
    def __init__(self, client: RegistryClient, reference: str, digest: str) -> None:
        self.client, self.ref, self.digest = client, parse_reference(reference), digest

    async def fetch(self, start: int, end: int) -> bytes:
        return await self.client.get_blob_range(self.ref, self.digest, start, end)

    async def aclose(self) -> None:
        return None


class S3Source:
    """Ranges of ``key`` in an object store; the store is built from the source's URL, endpoint and
    region plus this process's environment (its keys: never in a registration file)."""

    def __init__(self, store: Any, key: str) -> None:
        self.store, self.key = store, key

    async def fetch(self, start: int, end: int) -> bytes:
        import obstore

        got = await obstore.get_range_async(self.store, self.key, start=start, end=end)
        if len(got) != end - start:  # a short object: the chunk check would refuse it anyway
            raise ChunkError(f"{self.key}: {len(got)} bytes for range {start}-{end}")
        return bytes(got)

    async def aclose(self) -> None:
        return None


_stores: dict[tuple[str, str | None, str | None], Any] = {}


def object_store(url: str, endpoint: str | None, region: str | None) -> Any:
    """One store per (URL, endpoint, region) in this process: its connections are shared by images."""
    from aenv.object_store import store_from_url

    key = (url, endpoint, region)
    if key not in _stores:
        _stores[key] = store_from_url(url, endpoint, region, retry_timeout=2)  # a miss blocks a sandbox's read
    return _stores[key]


def source_of(desc: dict[str, Any], client: RegistryClient) -> Source:
    if desc.get("kind") == "dir":
        return DirSource(str(desc["path"]))
    if desc.get("kind") == "s3":
        endpoint, region = desc.get("endpoint"), desc.get("region")
        store = object_store(str(desc["url"]), str(endpoint) if endpoint else None, str(region) if region else None)
        return S3Source(store, str(desc["key"]))
    if desc.get("kind") == "registry":
        return RegistrySource(client, str(desc["reference"]), str(desc["digest"]))
    raise ValueError(f"unknown lazy source {desc.get('kind')!r}")


@dataclass
class _Image:
    index: LazyIndex
    source: Source
    touched: list[int] = field(default_factory=list)
    seen: set[int] = field(default_factory=set)


@dataclass
class Counters:
    fetched_bytes: int = 0
    fetched_chunks: int = 0
    requests: int = 0
    errors: int = 0
    per_chunk: dict[tuple[str, int], int] = field(default_factory=dict)


class LazyReader:
    def __init__(
        self,
        cache: ChunkCache,
        *,
        parallel: int = PARALLEL,
        max_run: int = MAX_RUN,
        coalesce_wait: float = 0.002,
    ) -> None:
        self.cache = cache
        self.max_run = max_run
        self.coalesce_wait = coalesce_wait
        self._sem = asyncio.Semaphore(parallel)
        self._images: dict[str, _Image] = {}
        self._inflight: dict[tuple[str, int], asyncio.Future[bytes]] = {}
        self._queue: dict[str, set[int]] = {}
        self._kick: dict[str, asyncio.Task[None]] = {}
        self._runs: set[asyncio.Task[None]] = set()
        self.counters = Counters()

    def add(self, name: str, index: LazyIndex, source: Source) -> None:
        self._images[name] = _Image(index, source)
        self.cache.add_image(name, index.size, index.chunk_size)

    def index(self, name: str) -> LazyIndex:
        return self._images[name].index

    def touched(self, name: str) -> list[int]:
        """Chunks read since ``add``, in first-touch order (the prefetch list a template build records)."""
        return list(self._images[name].touched)

    async def aclose(self) -> None:
        for t in [*self._kick.values(), *self._runs]:
            t.cancel()
        for img in self._images.values():
            await img.source.aclose()

    async def read(self, name: str, offset: int, size: int) -> bytes:
        img = self._images[name]
        want = img.index.chunks_of(offset, size)
        if not want:
            return b""
        for i in want:
            if i not in img.seen:
                img.seen.add(i)
                img.touched.append(i)
        parts = await asyncio.gather(*(self.chunk(name, i) for i in want))
        cs = img.index.chunk_size
        buf = b"".join(parts)
        start = offset - want.start * cs
        return buf[start : start + min(size, img.index.size - offset)]

    async def chunk(self, name: str, i: int) -> bytes:
        img = self._images[name]
        c = img.index.chunks[i]
        if c.zero:
            return bytes(img.index.chunk_len(i))
        data = self.cache.get(name, i)
        if data is not None:
            return data
        key = (name, i)
        fut = self._inflight.get(key)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._inflight[key] = fut
            self._queue.setdefault(name, set()).add(i)
            if name not in self._kick or self._kick[name].done():
                self._kick[name] = asyncio.create_task(self._dispatch(name))
        return await asyncio.shield(fut)

    async def prefetch(self, name: str, chunks: list[int] | tuple[int, ...] | None = None) -> int:
        """Fetch ``chunks`` (default: the index's prefetch list) into the cache; returns how many."""
        img = self._images[name]
        todo = [i for i in (img.index.prefetch if chunks is None else chunks) if not img.index.chunks[i].zero]
        todo = [i for i in todo if not self.cache.has(name, i)]
        results = await asyncio.gather(*(self.chunk(name, i) for i in todo), return_exceptions=True)
        return sum(1 for r in results if not isinstance(r, BaseException))

    async def _dispatch(self, name: str) -> None:
        await asyncio.sleep(self.coalesce_wait)  # let a burst of misses gather into runs
        pending = sorted(self._queue.pop(name, set()))
        if not pending:
            return
        img = self._images[name]
        runs: list[list[int]] = [[pending[0]]]
        for i in pending[1:]:
            run = runs[-1]
            first = img.index.chunks[run[0]]
            c = img.index.chunks[i]
            prev = img.index.chunks[run[-1]]
            if prev.offset + prev.length == c.offset and c.offset + c.length - first.offset <= self.max_run:
                run.append(i)
            else:
                runs.append([i])
        # Started, not awaited: this dispatch ends with the queue it popped, so a miss queued while these
        # fetches run starts a dispatch of its own (awaiting them here left such a miss waiting forever).
        for run in runs:
            task = asyncio.create_task(self._fetch_run(name, run))
            self._runs.add(task)
            task.add_done_callback(self._runs.discard)

    async def _fetch_run(self, name: str, run: list[int]) -> None:
        img = self._images[name]
        chunks = [img.index.chunks[i] for i in run]
        start, end = chunks[0].offset, chunks[-1].offset + chunks[-1].length
        try:
            async with self._sem:
                self.counters.requests += 1
                blob = await img.source.fetch(start, end)
            self.counters.fetched_bytes += len(blob)
            self.cache.note_fetched(name, len(blob))
        except Exception as exc:  # the source's own errors: every waiter gets one ChunkError
            self.counters.errors += 1
            log.error("lazy fetch failed image=%s chunks=%d-%d: %s", name, run[0], run[-1], exc)
            self._fail(name, run, ChunkError(f"{name}: chunks {run[0]}-{run[-1]}: {exc}"))
            return
        for i, c in zip(run, chunks, strict=True):
            key = (name, i)
            try:
                data = decode_chunk(img.index, i, blob[c.offset - start : c.offset - start + c.length])
            except LazyFormatError as exc:
                self.counters.errors += 1
                log.error("lazy chunk refused image=%s: %s", name, exc)
                self._fail(name, [i], ChunkError(f"{name}: {exc}"))
                continue
            self.counters.fetched_chunks += 1
            self.counters.per_chunk[key] = self.counters.per_chunk.get(key, 0) + 1
            await asyncio.to_thread(self.cache.put, name, i, data)
            fut = self._inflight.pop(key, None)
            if fut is not None and not fut.done():
                fut.set_result(data)

    def _fail(self, name: str, run: list[int], exc: ChunkError) -> None:
        for i in run:
            fut = self._inflight.pop((name, i), None)
            if fut is not None and not fut.done():
                fut.set_exception(exc)
                fut.exception()  # retrieved: a shielded waiter may be gone


def run_sync(loop: asyncio.AbstractEventLoop, coro: Callable[[], Awaitable[bytes]]) -> bytes:
    """From a FUSE thread: run a reader coroutine on the reader's loop and wait for it."""

    async def go() -> bytes:
        return await coro()

    return asyncio.run_coroutine_threadsafe(go(), loop).result()

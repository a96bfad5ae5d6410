"""Content-addressed layer cache shared by every image: verified blobs in, unpacked layer dirs out.

Layout under ``<cache_dir>/layers/``::

    index.db                 SQLite (WAL): one row per stored layer/blob, pins
    unpacked/<hex>/          one overlay-ready lower per layer blob (keyed by the blob's sha256)
    blobs/sha256/<hex>       compressed blobs (only with keep_blobs=True; unpacked dirs are what we use)
    tmp/<pid>/               downloads and unpacks in progress, per process; wiped when that pid is gone

Crash consistency: everything is written under ``tmp/`` and renamed into place only after its digest
(and the layer's diff_id) was verified; the index row is inserted after the rename. At start-up
``recover()`` deletes scratch of dead processes, rows whose files vanished and files without a row, and
drops pull pins of dead processes. Publishing (rename + row) and recovery hold one flock, so a second
process (a CLI next to the server) never sees, or deletes, a half-published layer. Eviction renames a
layer into ``tmp/`` first, so a half-deleted layer is never visible under its real name.

Budget and pins: ``layer_cache_bytes`` bounds the sum of stored sizes. Eviction is LRU by last use and
never touches a pinned digest; owners are strings such as ``template:<id>``, ``sandbox:<id>`` or
``pull:<pid>:<uuid>`` (pull pins protect a pull's own layers while later layers download). If everything left
is pinned the cache may exceed its budget rather than break a live sandbox; ``usage()`` says so.

Concurrency: one in-process future per digest, so two pulls of one image share each download. The
server is the only writer; the CLI talks to it over HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import shutil
import sqlite3
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aenv.errors import ImageError
from aenv.images.errors import CacheError, DigestMismatch
from aenv.images.manifest import Descriptor
from aenv.images.progress import ProgressCallback, PullEvent, emit
from aenv.images.reference import Reference
from aenv.images.registry import RegistryClient
from aenv.images.unpack import unpack_layer

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS layers(
    digest TEXT NOT NULL, kind TEXT NOT NULL, size INTEGER NOT NULL, diff_id TEXT,
    created REAL NOT NULL, last_used REAL NOT NULL, PRIMARY KEY(digest, kind));
CREATE TABLE IF NOT EXISTS pins(owner TEXT NOT NULL, digest TEXT NOT NULL, PRIMARY KEY(owner, digest));
"""


@dataclass(frozen=True)
class LayerInfo:
    digest: str  # compressed blob digest (manifest's)
    path: Path  # unpacked, overlay-ready directory
    size: int  # bytes counted against the budget
    diff_id: str | None
    reused: bool  # True when no download happened for this call


@dataclass(frozen=True)
class CacheEntry:
    digest: str
    kind: str  # "layer" or "blob"
    size: int
    last_used: float
    pinned_by: tuple[str, ...]


@dataclass(frozen=True)
class CacheUsage:
    used: int
    budget: int
    pinned: int
    entries: int

    @property
    def over_budget(self) -> bool:
        return self.used > self.budget


def _hex(digest: str) -> str:
    algo, _, hexpart = digest.partition(":")
    if algo != "sha256" or len(hexpart) != 64 or not all(c in "0123456789abcdef" for c in hexpart):
        raise ValueError(f"not a sha256 digest: {digest!r}")
    return hexpart


class LayerCache:
    def __init__(
        self,
        root: Path,
        budget_bytes: int,
        *,
        keep_blobs: bool = False,
        max_parallel: int = 3,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.root = root
        self.budget = budget_bytes
        self.keep_blobs = keep_blobs
        self.clock = clock
        self.downloads = 0  # blobs actually fetched by this process (tests and bench read it)
        self.bytes_downloaded = 0
        self._inflight: dict[str, asyncio.Future[LayerInfo]] = {}
        self._blobs_inflight: dict[str, asyncio.Future[Path]] = {}  # kept whole (ensure_blob)
        self._sem = asyncio.Semaphore(max_parallel)
        for d in ("unpacked", "blobs/sha256", "tmp"):
            (root / d).mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(root / "index.db", isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self.recover()

    @classmethod
    def from_settings(cls, settings: Any, **kw: Any) -> LayerCache:
        return cls(Path(settings.cache_dir) / "layers", int(settings.layer_cache_bytes), **kw)

    def close(self) -> None:
        self._db.close()

    # -- paths ---------------------------------------------------------------------------------------

    def layer_path(self, digest: str) -> Path:
        return self.root / "unpacked" / _hex(digest)

    def blob_path(self, digest: str) -> Path:
        return self.root / "blobs" / "sha256" / _hex(digest)

    def _tmp(self, prefix: str) -> Path:
        """Per-process scratch (``tmp/<pid>/``) so a second process's recover() leaves ours alone."""
        d = self.root / "tmp" / str(os.getpid())
        d.mkdir(exist_ok=True)
        return d / f"{prefix}-{uuid.uuid4().hex[:12]}"

    @contextlib.contextmanager
    def _publish_lock(self) -> Iterator[None]:
        """Cross-process lock around "rename into place + index row" and around recover()."""
        with open(self.root / ".publish.lock", "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _kind_path(self, digest: str, kind: str) -> Path:
        return self.layer_path(digest) if kind == "layer" else self.blob_path(digest)

    # -- crash recovery ------------------------------------------------------------------------------

    def recover(self) -> None:
        """Make index and disk agree after a crash; drop scratch and pull pins of dead processes."""
        with self._publish_lock():
            self._recover()

    def _recover(self) -> None:
        for child in (self.root / "tmp").iterdir():
            if child.name == str(os.getpid()) or not pid_alive(child.name):
                _rm(child)
        pulls = self._db.execute("SELECT DISTINCT owner FROM pins WHERE owner LIKE 'pull:%'").fetchall()
        for (owner,) in pulls:
            pid = owner.split(":")[1] if owner.count(":") >= 2 else ""
            if pid == str(os.getpid()) or not pid_alive(pid):
                self._db.execute("DELETE FROM pins WHERE owner=?", (owner,))
        rows = self._db.execute("SELECT digest, kind FROM layers").fetchall()
        known: set[tuple[str, str]] = set()
        for digest, kind in rows:
            if not self._kind_path(digest, kind).exists():
                self._db.execute("DELETE FROM layers WHERE digest=? AND kind=?", (digest, kind))
            else:
                known.add((digest, kind))
        for kind, folder in (("layer", self.root / "unpacked"), ("blob", self.root / "blobs" / "sha256")):
            for child in folder.iterdir():
                if (f"sha256:{child.name}", kind) not in known:
                    log.info("cache: removing orphan %s %s", kind, child.name)
                    _rm(child)

    # -- index ---------------------------------------------------------------------------------------

    def has_layer(self, digest: str) -> bool:
        row = self._db.execute("SELECT 1 FROM layers WHERE digest=? AND kind='layer'", (digest,)).fetchone()
        return row is not None and self.layer_path(digest).is_dir()

    def touch(self, digests: Iterable[str]) -> None:
        now = self.clock()
        self._db.executemany("UPDATE layers SET last_used=? WHERE digest=?", [(now, d) for d in digests])

    def pin(self, owner: str, digests: Iterable[str]) -> None:
        self._db.executemany(
            "INSERT OR IGNORE INTO pins(owner, digest) VALUES(?, ?)", [(owner, d) for d in digests]
        )

    def unpin(self, owner: str) -> None:
        self._db.execute("DELETE FROM pins WHERE owner=?", (owner,))

    def pins(self, owner: str | None = None) -> dict[str, set[str]]:
        q = "SELECT owner, digest FROM pins" + (" WHERE owner=?" if owner else "")
        out: dict[str, set[str]] = {}
        for o, d in self._db.execute(q, (owner,) if owner else ()):
            out.setdefault(o, set()).add(d)
        return out

    def entries(self) -> list[CacheEntry]:
        """Everything stored, least recently used first (``aenv cache ls``)."""
        pins: dict[str, list[str]] = {}
        for o, d in self._db.execute("SELECT owner, digest FROM pins"):
            pins.setdefault(d, []).append(o)
        return [
            CacheEntry(d, k, s, lu, tuple(sorted(pins.get(d, ()))))
            for d, k, s, lu in self._db.execute(
                "SELECT digest, kind, size, last_used FROM layers ORDER BY last_used ASC, created ASC"
            )
        ]

    def usage(self) -> CacheUsage:
        used, n = self._db.execute("SELECT COALESCE(SUM(size),0), COUNT(*) FROM layers").fetchone()
        (pinned,) = self._db.execute(
            "SELECT COALESCE(SUM(size),0) FROM layers WHERE digest IN (SELECT digest FROM pins)"
        ).fetchone()
        return CacheUsage(int(used), self.budget, int(pinned), int(n))

    def _insert(self, digest: str, kind: str, size: int, diff_id: str | None) -> None:
        now = self.clock()
        self._db.execute(
            "INSERT OR REPLACE INTO layers(digest, kind, size, diff_id, created, last_used)"
            " VALUES(?,?,?,?,?,?)",
            (digest, kind, size, diff_id, now, now),
        )

    def _info(self, digest: str, reused: bool) -> LayerInfo:
        size, diff_id = self._db.execute(
            "SELECT size, diff_id FROM layers WHERE digest=? AND kind='layer'", (digest,)
        ).fetchone()
        return LayerInfo(digest, self.layer_path(digest), int(size), diff_id, reused)

    # -- eviction ------------------------------------------------------------------------------------

    def evict(self, need_bytes: int = 0) -> list[CacheEntry]:
        """Drop unpinned entries, least recently used first, until ``used + need_bytes <= budget``.

        Called at pull time (with the size about to be added) and periodically by the server
        (``need_bytes=0``). Returns what was removed.
        """
        removed: list[CacheEntry] = []
        usage = self.usage()
        excess = usage.used + need_bytes - self.budget
        if excess <= 0:
            return removed
        for entry in self.entries():
            if excess <= 0:
                break
            if entry.pinned_by or self._busy(entry.digest):
                continue
            self._remove(entry)
            removed.append(entry)
            excess -= entry.size
        if excess > 0:
            log.warning("cache: over budget by %d bytes; everything left is pinned or in use", excess)
        return removed

    def prune(self, *, everything_unpinned: bool = False) -> list[CacheEntry]:
        """``aenv cache prune``: evict down to the budget, or drop every unpinned entry."""
        if not everything_unpinned:
            return self.evict()
        removed = []
        for entry in self.entries():
            if not entry.pinned_by and not self._busy(entry.digest):
                self._remove(entry)
                removed.append(entry)
        return removed

    def _busy(self, digest: str) -> bool:
        return digest in self._inflight or digest in self._blobs_inflight

    def _remove(self, entry: CacheEntry) -> None:
        path = self._kind_path(entry.digest, entry.kind)
        grave = self._tmp("evict")
        try:
            os.rename(path, grave)
        except FileNotFoundError:
            pass
        self._db.execute("DELETE FROM layers WHERE digest=? AND kind=?", (entry.digest, entry.kind))
        _rm(grave)
        log.info("cache: evicted %s %s (%d bytes)", entry.kind, entry.digest, entry.size)

    # -- fetching ------------------------------------------------------------------------------------

    async def ensure_layer(
        self,
        client: RegistryClient,
        ref: Reference,
        desc: Descriptor,
        *,
        diff_id: str | None = None,
        progress: ProgressCallback | None = None,
    ) -> LayerInfo:
        """The unpacked directory of ``desc``: from the cache, from a download already running, or new."""
        _hex(desc.digest)
        if self.has_layer(desc.digest):
            self.touch([desc.digest])
            emit(progress, PullEvent(str(ref), "cached", desc.digest, desc.size, desc.size))
            return self._info(desc.digest, reused=True)
        fut = self._inflight.get(desc.digest)
        if fut is not None:
            emit(progress, PullEvent(str(ref), "waiting", desc.digest, 0, desc.size, "shared download"))
            try:
                info = await asyncio.shield(fut)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task and task.cancelling():
                    raise
                # the pull that owned the download was killed; this one carries on by itself
                return await self.ensure_layer(client, ref, desc, diff_id=diff_id, progress=progress)
            emit(progress, PullEvent(str(ref), "done", desc.digest, desc.size, desc.size))
            return LayerInfo(info.digest, info.path, info.size, info.diff_id, reused=True)
        fut = asyncio.get_running_loop().create_future()
        self._inflight[desc.digest] = fut
        try:
            info = await self._fetch(client, ref, desc, diff_id, progress)
        except Exception as exc:
            fut.set_exception(exc)
            fut.exception()  # mark retrieved: a lone puller must not log "never retrieved"
            raise
        except BaseException:
            fut.cancel()
            raise
        else:
            fut.set_result(info)
            return info
        finally:
            self._inflight.pop(desc.digest, None)

    async def _fetch(
        self,
        client: RegistryClient,
        ref: Reference,
        desc: Descriptor,
        diff_id: str | None,
        progress: ProgressCallback | None,
    ) -> LayerInfo:
        r = str(ref)
        emit(progress, PullEvent(r, "waiting", desc.digest, 0, desc.size))
        blob_tmp = self._tmp("blob")
        layer_tmp = self._tmp("layer")
        try:
            async with self._sem:
                self.evict(need_bytes=desc.size)
                emit(progress, PullEvent(r, "downloading", desc.digest, 0, desc.size))
                await client.download_blob(
                    ref,
                    desc,
                    blob_tmp,
                    on_bytes=lambda n: emit(progress, PullEvent(r, "downloading", desc.digest, n, desc.size)),
                )
                self.downloads += 1
                self.bytes_downloaded += desc.size
                emit(progress, PullEvent(r, "verifying", desc.digest, desc.size, desc.size))
            loop = asyncio.get_running_loop()

            next_report = [0]

            def on_unpacked(n: int) -> None:  # runs in the worker thread: hop to the loop, every 4 MiB
                if progress is not None and n >= next_report[0]:
                    next_report[0] = n + (4 << 20)
                    loop.call_soon_threadsafe(emit, progress, PullEvent(r, "extracting", desc.digest, n, 0))

            stats = await asyncio.to_thread(
                unpack_layer,
                blob_tmp,
                layer_tmp,
                mode="overlay",
                reference=r,
                expected_diff_id=diff_id,
                on_bytes=on_unpacked,
            )
            self.evict(need_bytes=stats.bytes)
            with self._publish_lock():
                if self.layer_path(desc.digest).is_dir():  # another process published it meanwhile
                    if not self.has_layer(desc.digest):
                        self._insert(desc.digest, "layer", stats.bytes, stats.diff_id)
                else:
                    os.rename(layer_tmp, self.layer_path(desc.digest))
                    self._insert(desc.digest, "layer", stats.bytes, stats.diff_id)
                if self.keep_blobs and not self.blob_path(desc.digest).exists():
                    os.rename(blob_tmp, self.blob_path(desc.digest))
                    self._insert(desc.digest, "blob", desc.size, None)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise CacheError(r, f"disk full while storing {desc.digest}: {exc}") from exc
            raise CacheError(r, f"storing {desc.digest}: {exc}") from exc
        except ImageError:
            emit(progress, PullEvent(r, "error", desc.digest, 0, desc.size, "failed"))
            raise
        finally:
            _rm(blob_tmp)
            _rm(layer_tmp)
        emit(progress, PullEvent(r, "done", desc.digest, desc.size, desc.size))
        return self._info(desc.digest, reused=False)


    # -- whole blobs (Docker inside a sandbox loads them as they are) ------------------------------

    def has_blob(self, digest: str) -> bool:
        row = self._db.execute("SELECT 1 FROM layers WHERE digest=? AND kind='blob'", (digest,)).fetchone()
        return row is not None and self.blob_path(digest).is_file()

    async def ensure_blob(self, client: RegistryClient, ref: Reference, desc: Descriptor) -> Path:
        """The verified blob of ``desc`` as stored by the registry (compressed), downloaded once per node
        and shared (``blobs/sha256/<hex>``, counted in the budget like a layer). Callers pin it while they
        read it; concurrent callers share one download."""
        _hex(desc.digest)
        if self.has_blob(desc.digest):
            self.touch([desc.digest])
            return self.blob_path(desc.digest)
        return await self._single_flight(desc.digest, lambda: self._fetch_blob(client, ref, desc))

    async def ensure_plain_tar(self, blob: Path, diff_id: str, where: str) -> Path:
        """The uncompressed tar of a zstd layer ``blob``, kept under its diff_id (verified against it):
        Docker 20.10's ``docker load`` takes gzip layers, not zstd ones."""
        _hex(diff_id)
        if self.has_blob(diff_id):
            self.touch([diff_id])
            return self.blob_path(diff_id)

        async def make() -> Path:
            tmp = self._tmp("plain")
            try:
                size = await asyncio.to_thread(_decompress_zstd, blob, tmp, diff_id, where)
                return self._publish_blob(tmp, diff_id, size, where)
            finally:
                _rm(tmp)

        return await self._single_flight(diff_id, make)

    async def _single_flight(self, digest: str, make: Callable[[], Awaitable[Path]]) -> Path:
        fut = self._blobs_inflight.get(digest)
        if fut is not None:
            return await asyncio.shield(fut)
        fut = asyncio.get_running_loop().create_future()
        self._blobs_inflight[digest] = fut
        try:
            path = await make()
        except BaseException as exc:
            if isinstance(exc, Exception):
                fut.set_exception(exc)
                fut.exception()  # a lone caller must not log "never retrieved"
            else:
                fut.cancel()
            raise
        finally:
            self._blobs_inflight.pop(digest, None)
        fut.set_result(path)
        return path

    async def _fetch_blob(self, client: RegistryClient, ref: Reference, desc: Descriptor) -> Path:
        tmp = self._tmp("blob")
        try:
            async with self._sem:
                self.evict(need_bytes=desc.size)
                await client.download_blob(ref, desc, tmp)
                self.downloads += 1
                self.bytes_downloaded += desc.size
            return self._publish_blob(tmp, desc.digest, desc.size, str(ref))
        finally:
            _rm(tmp)

    def _publish_blob(self, tmp: Path, digest: str, size: int, where: str) -> Path:
        try:
            with self._publish_lock():
                if not self.blob_path(digest).is_file():
                    os.rename(tmp, self.blob_path(digest))
                self._insert(digest, "blob", size, None)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise CacheError(where, f"disk full while storing {digest}: {exc}") from exc
            raise CacheError(where, f"storing {digest}: {exc}") from exc
        return self.blob_path(digest)


def _decompress_zstd(blob: Path, out: Path, diff_id: str, where: str) -> int:
    """Decompress ``blob`` into ``out``, checking the result's sha256 against ``diff_id``; its size."""
    import hashlib

    import zstandard

    h, n = hashlib.sha256(), 0
    with open(blob, "rb") as src, open(out, "wb") as dst:
        reader = zstandard.ZstdDecompressor().stream_reader(src, read_across_frames=True)
        while chunk := reader.read(1 << 20):
            h.update(chunk)
            dst.write(chunk)
            n += len(chunk)
    if "sha256:" + h.hexdigest() != diff_id:
        raise DigestMismatch(where, diff_id, "sha256:" + h.hexdigest())
    return n


def _rm(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        pass


def pull_owner() -> str:
    """Pin owner of one pull; carries the pid so recover() in another process can tell it is alive."""
    return f"pull:{os.getpid()}:{uuid.uuid4().hex[:12]}"


def pid_alive(pid: str) -> bool:
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def evict_periodically(cache: LayerCache, interval: float = 300.0) -> None:
    """Server background task: keep the cache within budget as pins are released. Cancel to stop."""
    while True:
        await asyncio.sleep(interval)
        try:
            cache.evict()
        except Exception:  # noqa: BLE001 - a failed sweep must not kill the task; the next one retries
            log.exception("cache: periodic eviction failed")

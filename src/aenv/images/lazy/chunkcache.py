"""The node's chunk cache: one sparse file per lazy image, one global byte budget, LRU by hole punching.

Layout under ``root``::

    <name>.cache   sparse, the image's own offsets: chunk i lives at i * chunk_size
    chunks.db      SQLite (WAL): chunks(image, idx, size, sha256, last_used), images(name, …, pinned)

A chunk is written (``pwrite``) before its row is committed, and its row is deleted before its hole is
punched, so a reader killed at any point leaves at worst bytes without a row (ignored). Each row keeps
the sha256 of the uncompressed bytes: a chunk found from an earlier run is checked once on its first
read, so even a row whose bytes never reached the disk (power loss) is dropped, never served.

Thread-safe (one lock): FUSE threads read hits straight from here while the fetcher writes misses.
Pinned images are never evicted and do not count against the budget.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]

SCHEMA = """
CREATE TABLE IF NOT EXISTS chunks (image TEXT, idx INTEGER, size INTEGER, sha256 TEXT, last_used REAL,
                                   PRIMARY KEY (image, idx));
CREATE TABLE IF NOT EXISTS images (name TEXT PRIMARY KEY, size INTEGER, chunk_size INTEGER,
                                   pinned INTEGER DEFAULT 0, last_use REAL, fetched INTEGER DEFAULT 0);
"""


def punch_hole(fd: int, offset: int, length: int) -> None:
    if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@dataclass(slots=True)
class _Entry:
    size: int
    sha256: str
    used: float


@dataclass(frozen=True)
class ImageUsage:
    name: str
    size: int
    cached: int  # bytes of chunks held
    fetched: int  # bytes fetched over the network since it was registered
    last_use: float
    pinned: bool
    disk: int  # allocated bytes of its cache file


class ChunkCache:
    def __init__(self, root: Path, budget: int) -> None:
        self.root = root
        self.budget = budget
        root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(root / "chunks.db", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        self._fds: dict[str, int] = {}
        self._chunk_size: dict[str, int] = {}
        self._pinned: set[str] = set()
        # (image, idx) -> [size, sha256, last_used]; verified: checked in this process
        self._present: dict[tuple[str, int], _Entry] = {}
        self._verified: set[tuple[str, int]] = set()
        self._held: dict[tuple[str, int], int] = {}
        self._unpinned_bytes = 0
        self.evictions = 0
        for image, idx, size, sha, used in self._db.execute(
            "SELECT image, idx, size, sha256, last_used FROM chunks"
        ):
            self._present[(image, idx)] = _Entry(size, sha, used)
        for name, cs, pinned in self._db.execute("SELECT name, chunk_size, pinned FROM images"):
            self._chunk_size[name] = cs
            if pinned:
                self._pinned.add(name)
        self._unpinned_bytes = sum(v.size for k, v in self._present.items() if k[0] not in self._pinned)

    def close(self) -> None:
        with self._lock:
            self.flush_last_used()
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._db.close()

    # -- images ----------------------------------------------------------------------------------

    def add_image(self, name: str, size: int, chunk_size: int) -> None:
        """Open (create) ``name``'s sparse cache file. A known name keeps its chunks."""
        with self._lock:
            if name in self._fds:
                return
            known = self._chunk_size.get(name)
            if known is not None and known != chunk_size:
                self._drop_image_chunks(name)
            path = self.root / f"{name}.cache"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            self._fds[name] = fd
            self._chunk_size[name] = chunk_size
            self._db.execute(
                "INSERT INTO images(name, size, chunk_size, last_use) VALUES (?,?,?,?) "
                "ON CONFLICT(name) DO UPDATE SET size=excluded.size, chunk_size=excluded.chunk_size",
                (name, size, chunk_size, time.time()),
            )

    def set_pinned(self, name: str, pinned: bool) -> None:
        with self._lock:
            mine = sum(v.size for k, v in self._present.items() if k[0] == name)
            if pinned and name not in self._pinned:
                self._pinned.add(name)
                self._unpinned_bytes -= mine
            elif not pinned and name in self._pinned:
                self._pinned.discard(name)
                self._unpinned_bytes += mine
            self._db.execute("UPDATE images SET pinned=? WHERE name=?", (int(pinned), name))
            self._evict()

    def note_fetched(self, name: str, nbytes: int) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE images SET fetched=fetched+?, last_use=? WHERE name=?", (nbytes, time.time(), name)
            )

    # -- chunks ----------------------------------------------------------------------------------

    def has(self, name: str, idx: int) -> bool:
        with self._lock:
            return (name, idx) in self._present

    def get(self, name: str, idx: int) -> bytes | None:
        """The chunk's bytes, or None when absent (or found corrupt: then it is dropped)."""
        key = (name, idx)
        with self._lock:
            entry = self._present.get(key)
            if entry is None or name not in self._fds:
                return None
            entry.used = time.time()
            self._held[key] = self._held.get(key, 0) + 1
            fd, cs = self._fds[name], self._chunk_size[name]
            verify = key not in self._verified
        try:
            data = os.pread(fd, entry.size, idx * cs)
        finally:
            with self._lock:
                self._held[key] -= 1
                if not self._held[key]:
                    del self._held[key]
        if verify:
            if len(data) != entry.size or hashlib.sha256(data).hexdigest() != entry.sha256:
                with self._lock:
                    self._forget(key)
                return None
            with self._lock:
                self._verified.add(key)
        return data

    def put(self, name: str, idx: int, data: bytes) -> None:
        key = (name, idx)
        sha = hashlib.sha256(data).hexdigest()
        with self._lock:
            if key in self._present:
                return
            fd, cs = self._fds[name], self._chunk_size[name]
        os.pwrite(fd, data, idx * cs)
        now = time.time()
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO chunks VALUES (?,?,?,?,?)", (name, idx, len(data), sha, now)
            )
            self._present[key] = _Entry(len(data), sha, now)
            self._verified.add(key)
            if name not in self._pinned:
                self._unpinned_bytes += len(data)
            self._evict(keep=key)

    def _forget(self, key: tuple[str, int]) -> None:
        entry = self._present.pop(key, None)
        self._verified.discard(key)
        if entry is None:
            return
        self._db.execute("DELETE FROM chunks WHERE image=? AND idx=?", key)
        if key[0] not in self._pinned:
            self._unpinned_bytes -= entry.size
        fd = self._fds.get(key[0])
        if fd is not None:
            punch_hole(fd, key[1] * self._chunk_size[key[0]], entry.size)

    def _evict(self, keep: tuple[str, int] | None = None) -> None:
        if self._unpinned_bytes <= self.budget:
            return
        victims = sorted(
            (v.used, k)
            for k, v in self._present.items()
            if k[0] not in self._pinned and k not in self._held and k != keep
        )
        for _, key in victims:
            if self._unpinned_bytes <= self.budget:
                break
            self._forget(key)
            self.evictions += 1

    def _drop_image_chunks(self, name: str) -> None:
        for key in [k for k in self._present if k[0] == name]:
            self._forget(key)

    def flush_last_used(self) -> None:
        with self._lock:
            self._db.executemany(
                "UPDATE chunks SET last_used=? WHERE image=? AND idx=?",
                [(v.used, k[0], k[1]) for k, v in self._present.items()],
            )

    def usage(self) -> list[ImageUsage]:
        with self._lock:
            self.flush_last_used()
            rows = list(
                self._db.execute("SELECT name, size, pinned, last_use, fetched FROM images ORDER BY name")
            )
            out = []
            for name, size, pinned, last_use, fetched in rows:
                cached = sum(v.size for k, v in self._present.items() if k[0] == name)
                try:
                    disk = (self.root / f"{name}.cache").stat().st_blocks * 512
                except OSError:
                    disk = 0
                out.append(ImageUsage(name, size, cached, fetched, last_use or 0.0, bool(pinned), disk))
            return out

    @property
    def unpinned_bytes(self) -> int:
        return self._unpinned_bytes

"""``aenv-lazyd``: one per node. Serves every registered lazy image as a read-only file on FUSE.

Run as ``python -m aenv.images.lazy.daemon --root DIR --budget BYTES`` (``lazyd.LazyDaemon`` starts
and supervises it; it outlives the server, like the sandboxes whose root filesystems it serves)::

    DIR/mnt/<name>.img        the images (FUSE, 0444; kernel page cache kept across opens)
    DIR/images/<name>.json    registrations: {"index": {…}, "source": {…}}; written by the server
    DIR/cache/                the chunk cache (chunkcache.py)
    DIR/daemon.pid

Control without a socket, on the image file itself: ``setxattr user.aenv.pin 1|0`` pins (and fetches
every chunk) or unpins; ``getxattr user.aenv.stats`` is JSON (size, cached, fetched, touched…).
A read the reader cannot serve (source down, chunk refused) is EIO, logged with image and chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import logging
import os
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import mfusepy

from aenv.images.lazy.chunkcache import ChunkCache
from aenv.images.lazy.format import LazyFormatError, parse_index
from aenv.images.lazy.reader import ChunkError, LazyReader, source_of
from aenv.images.registry import RegistryClient

log = logging.getLogger("aenv.lazy")
SUFFIX = ".img"
PIN_XATTR = "user.aenv.pin"
STATS_XATTR = "user.aenv.stats"


class LazyFS(mfusepy.Operations):  # type: ignore[misc]
    use_ns = True

    def __init__(
        self, root: Path, reader: LazyReader, client: RegistryClient, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.root, self.reader, self.client, self.loop = root, reader, client, loop
        self._lock = threading.Lock()
        self._sizes: dict[str, int] = {}
        self._started = time.time_ns()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def _name(self, path: str) -> str:
        name = path.lstrip("/")
        if "/" in name or not name.endswith(SUFFIX):
            raise mfusepy.FuseOSError(errno.ENOENT)
        return name[: -len(SUFFIX)]

    def _load(self, name: str) -> int:
        with self._lock:
            if name in self._sizes:
                return self._sizes[name]
            try:
                doc = json.loads((self.root / "images" / f"{name}.json").read_bytes())
                index = parse_index(json.dumps(doc["index"]).encode())
                source = source_of(doc["source"], self.client)
            except FileNotFoundError:
                raise mfusepy.FuseOSError(errno.ENOENT) from None
            except (OSError, ValueError, KeyError, LazyFormatError) as exc:
                log.error("lazy image %s: bad registration: %s", name, exc)
                raise mfusepy.FuseOSError(errno.EIO) from exc
            self.reader.add(name, index, source)
            self._sizes[name] = index.size
        if index.prefetch:  # a cold start replays what the first start touched
            asyncio.run_coroutine_threadsafe(self.reader.prefetch(name), self.loop)
        return index.size

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        if path == "/":
            return self._attrs(stat.S_IFDIR | 0o555, 0)
        return self._attrs(stat.S_IFREG | 0o444, self._load(self._name(path)))

    def _attrs(self, mode: int, size: int) -> dict[str, Any]:
        t = self._started
        return {"st_mode": mode, "st_nlink": 1, "st_size": size, "st_blocks": (size + 511) // 512,
                "st_atime": t, "st_mtime": t, "st_ctime": t}  # fmt: skip

    def readdir(self, path: str, fh: int) -> list[str]:
        names = sorted(p.stem + SUFFIX for p in (self.root / "images").glob("*.json"))
        return [".", "..", *names]

    def open(self, path: str, flags: int) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise mfusepy.FuseOSError(errno.EROFS)
        self._load(self._name(path))
        return 0

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        name = self._name(path)
        try:
            return bytes(self._call(self.reader.read(name, offset, size)))
        except ChunkError:
            raise mfusepy.FuseOSError(errno.EIO) from None
        except KeyError:
            raise mfusepy.FuseOSError(errno.ENOENT) from None

    def getxattr(self, path: str, name: str, position: int = 0) -> bytes:
        img = self._name(path)
        self._load(img)
        if name == STATS_XATTR:
            return json.dumps(self._stats(img)).encode()
        raise mfusepy.FuseOSError(errno.ENODATA)

    def listxattr(self, path: str) -> list[str]:
        return [STATS_XATTR]

    def setxattr(self, path: str, name: str, value: bytes, options: int, position: int = 0) -> int:
        img = self._name(path)
        self._load(img)
        if name != PIN_XATTR:
            raise mfusepy.FuseOSError(errno.ENOTSUP)
        pinned = value.strip() in (b"1", b"true")
        self.reader.cache.set_pinned(img, pinned)
        if pinned:
            index = self.reader.index(img)
            got = self._call(self.reader.prefetch(img, list(range(len(index.chunks)))))
            missing = sum(
                1 for i, c in enumerate(index.chunks) if not c.zero and not self.reader.cache.has(img, i)
            )
            if missing:
                log.error("lazy pin %s: %d chunks could not be fetched (%d were)", img, missing, got)
                raise mfusepy.FuseOSError(errno.EIO)
        return 0

    def _stats(self, img: str) -> dict[str, Any]:
        usage = next((u for u in self.reader.cache.usage() if u.name == img), None)
        c = self.reader.counters
        mine = [n for (name, _), n in c.per_chunk.items() if name == img]
        index = self.reader.index(img)
        return {
            "size": index.size,
            "stored": index.stored_bytes,
            "chunks": len(index.chunks),
            "cached": usage.cached if usage else 0,
            "disk": usage.disk if usage else 0,
            "fetched": usage.fetched if usage else 0,
            "last_use": usage.last_use if usage else 0,
            "pinned": usage.pinned if usage else False,
            "chunks_fetched": len(mine),
            "max_fetches_per_chunk": max(mine, default=0),
            "touched": self.reader.touched(img),
            # the stored (non-zero) chunks reads touched: what a cold cache fetches, prefetch aside
            "chunks_touched": sum(1 for i in self.reader.touched(img) if not index.chunks[i].zero),
            "evictions": self.reader.cache.evictions,
            "cache_unpinned_bytes": self.reader.cache.unpinned_bytes,
        }


def unmount_stale(mnt: Path) -> None:
    """A mount left by a killed daemon answers ENOTCONN: detach it before mounting anew."""
    try:
        os.stat(mnt)
        alive = not os.path.ismount(mnt)
    except OSError:
        alive = False
    if not alive:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="aenv-lazyd")
    ap.add_argument("--root", required=True, type=Path)
    ap.add_argument("--budget", required=True, type=int)
    ap.add_argument("--mirrors", default="{}")
    ap.add_argument("--insecure", default="")
    ap.add_argument("--parallel", type=int, default=8)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    root: Path = args.root
    for d in ("mnt", "images", "cache"):
        (root / d).mkdir(parents=True, exist_ok=True)
    unmount_stale(root / "mnt")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="lazy-loop", daemon=True)
    thread.start()
    cache = ChunkCache(root / "cache", args.budget)

    async def make() -> tuple[LazyReader, RegistryClient]:
        client = RegistryClient(
            mirrors=json.loads(args.mirrors),
            insecure=[h for h in args.insecure.split(",") if h],
            attempts=3,  # a miss blocks a sandbox's read: fail within about a second
            backoff=0.1,
        )
        return LazyReader(cache, parallel=args.parallel), client

    reader, client = asyncio.run_coroutine_threadsafe(make(), loop).result()
    ops = LazyFS(root, reader, client, loop)
    (root / "daemon.pid").write_text(str(os.getpid()))
    # libfuse's own SIGTERM/SIGINT handlers end the session and unmount (the main thread sits in C)
    log.info("aenv-lazyd serving %s (budget %d bytes)", root / "mnt", args.budget)
    try:
        mfusepy.FUSE(
            ops,
            str(root / "mnt"),
            foreground=True,
            nothreads=False,
            allow_other=True,
            kernel_cache=True,
            attr_timeout=3600,
            entry_timeout=3600,
            fsname="aenv-lazy",
        )
    finally:

        async def close() -> None:
            await reader.aclose()
            await client.aclose()

        asyncio.run_coroutine_threadsafe(close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        cache.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The lazy image format: a read-only filesystem image cut into independently compressed chunks.

An image file (ext4 today) of ``size`` bytes is split into ``chunk_size`` slices (1 MiB). Each slice
is compressed on its own with zstd and appended to one *data* blob; a slice of only zeros is not
stored (``length == 0``), so an ext4's free space costs nothing. The *index* (JSON, a few tens of KB
for a GiB) says where each slice lies in the data blob and its sha256 (of the compressed bytes, so a
reader checks what it fetched before it decompresses anything)::

    {"format": "aenv-lazy/1", "size": N, "chunk_size": 1048576, "compression": "zstd",
     "data_digest": "sha256:…", "data_size": M,
     "chunks": [[offset, length, "hex"], …],       # one per slice; [0, 0, ""] = all zeros
     "prefetch": [i, …]}                            # slices a first start touched, in order

This module is pure: it chunks a file, parses and checks an index, decodes one chunk. Where the
blobs live (registry artifact or store) is ``publish.py``; who reads them is ``reader.py``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import zstandard

FORMAT = "aenv-lazy/1"
CHUNK_SIZE = 1 << 20
MAX_INDEX_BYTES = 64 << 20  # 2^20 chunks of ~60 bytes: a 1 TiB image
MAX_CHUNKS = 1 << 20
ZSTD_LEVEL = 3


class LazyFormatError(ValueError):
    """An index that cannot be trusted, or a chunk whose bytes are not the ones the index names."""


@dataclass(frozen=True)
class Chunk:
    offset: int  # in the data blob
    length: int  # compressed bytes; 0 = a chunk of zeros, not stored
    sha256: str  # hex of the compressed bytes ("" for a zero chunk)

    @property
    def zero(self) -> bool:
        return self.length == 0


@dataclass(frozen=True)
class LazyIndex:
    size: int
    chunk_size: int
    chunks: tuple[Chunk, ...]
    data_digest: str = ""
    data_size: int = 0
    prefetch: tuple[int, ...] = field(default=())

    def chunk_len(self, i: int) -> int:
        """Uncompressed length of chunk ``i`` (the last one may be short)."""
        return min(self.chunk_size, self.size - i * self.chunk_size)

    def chunks_of(self, offset: int, size: int) -> range:
        """The chunk numbers a read of ``size`` bytes at ``offset`` touches (clipped to the image)."""
        end = min(offset + size, self.size)
        if size <= 0 or offset >= end:
            return range(0)
        return range(offset // self.chunk_size, (end - 1) // self.chunk_size + 1)

    @property
    def stored_bytes(self) -> int:
        return sum(c.length for c in self.chunks)

    def with_prefetch(self, chunks: list[int] | tuple[int, ...]) -> LazyIndex:
        seen: dict[int, None] = {}
        for i in chunks:
            if 0 <= i < len(self.chunks) and not self.chunks[i].zero:
                seen.setdefault(i, None)
        return replace(self, prefetch=tuple(seen))

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "size": self.size,
            "chunk_size": self.chunk_size,
            "compression": "zstd",
            "data_digest": self.data_digest,
            "data_size": self.data_size,
            "chunks": [[c.offset, c.length, c.sha256] for c in self.chunks],
            "prefetch": list(self.prefetch),
        }

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":")).encode()


def parse_index(data: bytes) -> LazyIndex:
    """Parse and check an index: bounded, every chunk inside the data blob, sizes consistent."""
    if len(data) > MAX_INDEX_BYTES:
        raise LazyFormatError(f"index larger than {MAX_INDEX_BYTES} bytes")
    try:
        doc = json.loads(data)
        if doc.get("format") != FORMAT or doc.get("compression") != "zstd":
            raise LazyFormatError(f"not an {FORMAT} zstd index: {doc.get('format')!r}")
        size, chunk_size = int(doc["size"]), int(doc["chunk_size"])
        data_size = int(doc["data_size"])
        chunks = tuple(Chunk(int(o), int(n), str(h)) for o, n, h in doc["chunks"])
        prefetch = tuple(int(i) for i in doc.get("prefetch") or ())
        digest = str(doc["data_digest"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        if isinstance(exc, LazyFormatError):
            raise
        raise LazyFormatError(f"malformed index: {exc}") from exc
    if chunk_size <= 0 or chunk_size > 64 << 20 or size < 0:
        raise LazyFormatError(f"bad sizes: size={size} chunk_size={chunk_size}")
    want = -(-size // chunk_size)
    if len(chunks) != want or want > MAX_CHUNKS:
        raise LazyFormatError(f"{len(chunks)} chunks for {size} bytes (want {want}, at most {MAX_CHUNKS})")
    for i, c in enumerate(chunks):
        if c.length < 0 or c.offset < 0 or c.offset + c.length > data_size:
            raise LazyFormatError(f"chunk {i} lies outside the data blob")
        if c.length and len(c.sha256) != 64:
            raise LazyFormatError(f"chunk {i} has no sha256")
    if any(not 0 <= i < len(chunks) for i in prefetch):
        raise LazyFormatError("prefetch names a chunk that does not exist")
    return LazyIndex(size, chunk_size, chunks, digest, data_size, prefetch)


def decode_chunk(index: LazyIndex, i: int, blob: bytes) -> bytes:
    """The uncompressed bytes of chunk ``i`` from its compressed bytes, refusing any mismatch."""
    c = index.chunks[i]
    n = index.chunk_len(i)
    if c.zero:
        return bytes(n)
    if len(blob) != c.length:
        raise LazyFormatError(f"chunk {i}: {len(blob)} bytes, the index says {c.length}")
    actual = hashlib.sha256(blob).hexdigest()
    if actual != c.sha256:
        raise LazyFormatError(f"chunk {i}: sha256 {actual[:16]}… is not {c.sha256[:16]}…")
    try:
        out = zstandard.ZstdDecompressor().decompress(blob, max_output_size=n)
    except zstandard.ZstdError as exc:
        raise LazyFormatError(f"chunk {i}: {exc}") from exc
    if len(out) != n:
        raise LazyFormatError(f"chunk {i}: {len(out)} bytes uncompressed, want {n}")
    return out


def chunkify(image: Path, data_out: Path, *, chunk_size: int = CHUNK_SIZE) -> LazyIndex:
    """Cut ``image`` into chunks, write the data blob to ``data_out``; returns the index (blocking)."""
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
    digest = hashlib.sha256()
    chunks: list[Chunk] = []
    pos = 0
    size = image.stat().st_size
    with open(image, "rb") as src, open(data_out, "wb") as out:
        while raw := src.read(chunk_size):
            if raw.count(0) == len(raw):
                chunks.append(Chunk(0, 0, ""))
                continue
            blob = cctx.compress(raw)
            out.write(blob)
            digest.update(blob)
            chunks.append(Chunk(pos, len(blob), hashlib.sha256(blob).hexdigest()))
            pos += len(blob)
    return LazyIndex(size, chunk_size, tuple(chunks), "sha256:" + digest.hexdigest(), pos)

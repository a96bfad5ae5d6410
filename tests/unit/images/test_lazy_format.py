"""The lazy format: chunking, the index's checks, and chunks refused when their bytes are wrong."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aenv.images.lazy.format import LazyFormatError, LazyIndex, chunkify, decode_chunk, parse_index

CS = 64 << 10


def make_image(path: Path) -> bytes:
    data = bytearray(os.urandom(CS)) + bytes(3 * CS) + b"abc" * 30000 + os.urandom(1000)
    path.write_bytes(bytes(data))
    return bytes(data)


def read_chunk(data: Path, index: LazyIndex, i: int) -> bytes:
    c = index.chunks[i]
    with open(data, "rb") as fh:
        return os.pread(fh.fileno(), c.length, c.offset)


def test_chunkify_round_trip_and_zero_chunks(tmp_path: Path) -> None:
    raw = make_image(tmp_path / "img")
    index = chunkify(tmp_path / "img", tmp_path / "data", chunk_size=CS)
    assert index.size == len(raw) and len(index.chunks) == -(-len(raw) // CS)
    assert [c.zero for c in index.chunks[:4]] == [False, True, True, True]
    assert index.data_size == (tmp_path / "data").stat().st_size == index.stored_bytes
    again = parse_index(index.dumps())
    assert again == index
    out = b"".join(
        decode_chunk(again, i, read_chunk(tmp_path / "data", again, i)) for i in range(len(again.chunks))
    )
    assert out == raw
    assert index.chunk_len(len(index.chunks) - 1) == len(raw) % CS or CS


def test_chunks_of_clips_to_the_image(tmp_path: Path) -> None:
    make_image(tmp_path / "img")
    index = chunkify(tmp_path / "img", tmp_path / "data", chunk_size=CS)
    assert list(index.chunks_of(0, 1)) == [0]
    assert list(index.chunks_of(CS - 1, 2)) == [0, 1]
    assert list(index.chunks_of(index.size, 10)) == []
    assert list(index.chunks_of(index.size - 1, 1 << 30)) == [len(index.chunks) - 1]


def test_a_corrupted_chunk_is_refused(tmp_path: Path) -> None:
    make_image(tmp_path / "img")
    index = chunkify(tmp_path / "img", tmp_path / "data", chunk_size=CS)
    blob = bytearray(read_chunk(tmp_path / "data", index, 0))
    blob[len(blob) // 2] ^= 1
    with pytest.raises(LazyFormatError, match="sha256"):
        decode_chunk(index, 0, bytes(blob))
    with pytest.raises(LazyFormatError, match="bytes"):
        decode_chunk(index, 0, bytes(blob[:-1]))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(format="other"),
        lambda d: d.update(chunk_size=0),
        lambda d: d["chunks"].pop(),
        lambda d: d["chunks"][0].__setitem__(0, d["data_size"]),
        lambda d: d["chunks"][0].__setitem__(2, "short"),
        lambda d: d.update(prefetch=[10**6]),
        lambda d: d.pop("size"),
    ],
)
def test_a_bad_index_is_refused(tmp_path: Path, mutate: object) -> None:
    make_image(tmp_path / "img")
    doc = chunkify(tmp_path / "img", tmp_path / "data", chunk_size=CS).to_json()
    mutate(doc)  # type: ignore[operator]
    import json

    with pytest.raises(LazyFormatError):
        parse_index(json.dumps(doc).encode())
    with pytest.raises(LazyFormatError):
        parse_index(b"not json")


def test_prefetch_keeps_first_touch_order_without_zero_chunks(tmp_path: Path) -> None:
    make_image(tmp_path / "img")
    index = chunkify(tmp_path / "img", tmp_path / "data", chunk_size=CS)
    assert index.with_prefetch([5, 1, 0, 5, 99]).prefetch == (5, 0)

"""Upload helpers: metadata headers and streaming multipart with full-path filenames."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aenv.envd.files import HTTPError, MultipartSink, parse_metadata
from aenv.envd.identity import SandboxState, User


def _user(home: str) -> User:
    return User("me", os.geteuid(), os.getegid(), home)


def test_parse_metadata() -> None:
    assert parse_metadata({"X-Metadata-Owner": "Alice", "Other": "x"}) == {"owner": "Alice"}
    with pytest.raises(HTTPError) as info:
        parse_metadata({"X-Metadata-K": "caf\u00e9"})
    assert info.value.status == 400
    with pytest.raises(HTTPError):
        parse_metadata({"X-Metadata-" + "k" * 247: "v"})
    with pytest.raises(HTTPError):
        parse_metadata({f"X-Metadata-k{i}": "v" * 100 for i in range(50)})


def _multipart(boundary: str, parts: list[tuple[str, str, bytes]]) -> bytes:
    out = b""
    for name, filename, data in parts:
        out += (
            (
                f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
                "Content-Type: application/octet-stream\r\n\r\n"
            ).encode()
            + data
            + b"\r\n"
        )
    return out + f"--{boundary}--\r\n".encode()


def test_multipart_full_paths_streamed_in_small_chunks(tmp_path: Path) -> None:
    body = _multipart(
        "BOUND",
        [
            ("file", str(tmp_path / "a" / "one.txt"), b"1" * 5000),
            ("other", "ignored", b"zzz"),
            ("file", "rel/two.txt", b"22"),
        ],
    )
    sink = MultipartSink(b"BOUND", SandboxState(), _user(str(tmp_path)), None, {})
    for i in range(0, len(body), 7):
        sink.feed(body[i : i + 7])
    results = sink.finish()
    assert [r["path"] for r in results] == [
        str(tmp_path / "a" / "one.txt"),
        str(tmp_path / "rel" / "two.txt"),
    ]
    assert (tmp_path / "a" / "one.txt").read_bytes() == b"1" * 5000
    assert (tmp_path / "rel" / "two.txt").read_bytes() == b"22"
    assert not (tmp_path / "ignored").exists()


def test_multipart_duplicate_destination_rejected(tmp_path: Path) -> None:
    body = _multipart("B", [("file", "x", b"1"), ("file", "y", b"2")])
    sink = MultipartSink(b"B", SandboxState(), _user(str(tmp_path)), str(tmp_path / "same"), {})
    with pytest.raises(HTTPError) as info:
        sink.feed(body)
    assert info.value.status == 400
    sink.abort()


def test_multipart_truncated_body(tmp_path: Path) -> None:
    body = _multipart("B", [("file", str(tmp_path / "t"), b"data")])
    sink = MultipartSink(b"B", SandboxState(), _user(str(tmp_path)), None, {})
    sink.feed(body[:-20])
    with pytest.raises(HTTPError):
        sink.finish()


async def test_download_length_is_the_length_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file rewritten while it is read (``echo 10 > f`` after a stat saw "9\\n"): the body and its
    Content-Length come from one read, never a stat from before it."""
    from aenv.envd import files

    f = tmp_path / "counter"
    f.write_bytes(b"10\n")
    real_fstat = os.fstat
    monkeypatch.setattr(files.os, "fstat", lambda fd: os.stat_result((*real_fstat(fd)[:6], 2, *real_fstat(fd)[7:])))
    resp = await files.download_response(str(f))
    assert resp.body == b"10\n"
    assert resp.headers["content-length"] == "3"
    assert resp.headers["content-disposition"] == 'inline; filename="counter"'


async def test_download_of_a_large_file_stops_at_its_size_when_opened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from aenv.envd import files

    monkeypatch.setattr(files, "WHOLE_READ_MAX", 10)
    monkeypatch.setattr(files, "DOWNLOAD_CHUNK", 4)
    f = tmp_path / "log ü.txt"
    f.write_bytes(b"0123456789abcdef")
    resp = await files.download_response(str(f))
    with f.open("ab") as out:
        out.write(b"appended later")
    body = b"".join([chunk async for chunk in resp.body_iterator])  # type: ignore[attr-defined]
    assert body == b"0123456789abcdef" and resp.headers["content-length"] == "16"
    assert resp.headers["content-disposition"] == "inline; filename*=utf-8''log%20%C3%BC.txt"


async def test_download_reads_files_whose_stat_size_is_zero() -> None:
    from aenv.envd import files

    resp = await files.download_response("/proc/self/status")
    assert b"Name:" in resp.body and resp.headers["content-length"] == str(len(resp.body))

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from aenv.runtime.base import SandboxImage, SandboxSpec
from aenv.runtime.envd_client import (
    EnvdError,
    Response,
    build_request,
    exchange,
    init_payload,
    parse_response,
    read_response,
    request,
    response_complete,
    run_process,
)


class FakeStream:
    def __init__(self, reply: bytes) -> None:
        self.sent = b""
        self._reply = [reply[i:i + 7] for i in range(0, len(reply), 7)]
        self.closed = False

    async def write(self, data: bytes) -> None:
        self.sent += data

    async def write_eof(self) -> None:
        pass

    async def read(self, n: int = 65536) -> bytes:
        return self._reply.pop(0) if self._reply else b""

    async def aclose(self) -> None:
        self.closed = True


def test_build_request_with_body() -> None:
    raw = build_request("POST", "/init", b'{"a":1}')
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /init HTTP/1.1\r\n")
    assert b"Content-Length: 7" in head and b"Connection: close" in head
    assert body == b'{"a":1}'


def test_parse_response() -> None:
    assert parse_response(b"HTTP/1.1 204 No Content\r\n\r\n") == Response(204, {}, b"")
    assert parse_response(b"HTTP/1.1 400 Bad\r\nX-Aenv: y \r\n\r\noops") == Response(400, {"x-aenv": "y"}, b"oops")
    with pytest.raises(EnvdError):
        parse_response(b"HTTP/1.1 204")
    with pytest.raises(EnvdError):
        parse_response(b"garbage\r\n\r\n")


async def test_exchange_returns_headers_and_closes() -> None:
    s = FakeStream(b"HTTP/1.1 200 OK\r\nX-Aenv-Host-Facts: hostTime=set\r\n\r\n{}")
    raw = build_request("POST", "/init", b"{}", {"X-A": "1"}, "text/plain")
    assert await exchange(s, raw) == Response(200, {"x-aenv-host-facts": "hostTime=set"}, b"{}")
    assert s.closed and s.sent == raw and b"Content-Type: text/plain" in raw and b"X-A: 1" in raw


async def test_too_large_answer_raises_and_run_process_says_none() -> None:
    big = b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * (1 << 20)
    with pytest.raises(EnvdError, match="too large"):
        await exchange(FakeStream(big), b"GET / HTTP/1.1\r\n\r\n")
    assert await run_process(FakeStream(big), "/bin/true", []) is None
    assert await run_process(FakeStream(b""), "/bin/true", []) is None  # the stream ended at once


async def test_request_reads_to_eof_and_closes() -> None:
    s = FakeStream(b"HTTP/1.1 204 No Content\r\nServer: x\r\n\r\n")
    spec = SandboxSpec("s1", SandboxImage("t", Path("/rootfs")), Path("/work/s1"), env_vars={"A": "1"})
    payload = init_payload(spec)
    assert await request(s, "POST", "/init", payload) == (204, b"")
    assert s.closed
    body = s.sent.partition(b"\r\n\r\n")[2]
    assert json.loads(body) == {"envVars": {"A": "1"}, "accessToken": None, "defaultUser": "user",
                                "defaultWorkdir": None, "sandboxId": "s1", "templateId": "t"}


@pytest.mark.parametrize(("raw", "complete"), [
    (b"HTTP/1.1 204 No Content\r\nServer: x\r\n\r\n", True),
    (b"HTTP/1.1 204 No Content\r\nServer: x\r\n", False),  # head not finished
    (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nabc", False),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nabcde", True),
    (b"HTTP/1.1 400 Bad\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n", False),
    (b"HTTP/1.1 400 Bad\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n", True),
    (b"HTTP/1.1 200 OK\r\n\r\nuntil EOF", False),  # neither length nor chunked: only EOF tells
    (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", False),
])
def test_response_complete(raw: bytes, complete: bool) -> None:
    assert response_complete(raw) is complete


class HangingStream(FakeStream):
    """Answers, then never sends EOF (a peer slow to close): the read must not wait for it."""

    async def read(self, n: int = 65536) -> bytes:
        if self._reply:
            return self._reply.pop(0)
        await asyncio.Event().wait()
        return b""


async def test_read_response_stops_at_a_complete_answer() -> None:
    s = HangingStream(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nbody")
    async with asyncio.timeout(5):
        assert await read_response(s) == (200, b"body")
    assert s.closed


async def test_read_response_without_length_reads_to_eof() -> None:
    s = FakeStream(b"HTTP/1.1 200 OK\r\nServer: x\r\n\r\nall of it")
    assert await read_response(s) == (200, b"all of it")


def test_exit_code_and_dechunk() -> None:
    import json

    from aenv.runtime.envd_client import dechunk, exit_code, process_body

    def env(msg: dict[str, object], flags: int = 0) -> bytes:
        raw = json.dumps(msg).encode()
        return bytes([flags]) + len(raw).to_bytes(4, "big") + raw

    body = env({"event": {"start": {"pid": 7}}}) + env({"event": {"end": {"exitCode": 3}}}) + env({}, flags=2)
    assert exit_code(body) == 3
    assert exit_code(env({"event": {"end": {}}})) == 0  # proto3 JSON omits a zero exit code
    assert exit_code(env({"event": {"start": {"pid": 7}}})) is None  # no end event yet
    chunked = b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in (body[:10], body[10:])) + b"0\r\n\r\n"
    assert dechunk(chunked) == body
    assert process_body("/bin/sh", ["-c", "true"])[5:] == b'{"process": {"cmd": "/bin/sh", "args": ["-c", "true"]}}'


async def _chunks(*parts: bytes):  # type: ignore[no-untyped-def]
    for part in parts:
        yield part


async def test_upload_stream_sends_the_announced_length_and_checks_it() -> None:
    from aenv.runtime.envd_client import upload_stream

    s = FakeStream(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]")
    await upload_stream(s, "/var/x y.tar", 6, _chunks(b"abc", b"def"), token="tok")
    head, _, body = s.sent.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /files?path=/var/x%20y.tar&username=root HTTP/1.1")
    assert b"Content-Length: 6" in head and b"X-Access-Token: tok" in head and body == b"abcdef" and s.closed
    for size, parts in ((5, (b"abc", b"def")), (7, (b"abc", b"def"))):
        s = FakeStream(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]")
        with pytest.raises(EnvdError, match="announced"):
            await upload_stream(s, "/x", size, _chunks(*parts))
        assert s.closed
    s = FakeStream(b"HTTP/1.1 507 Insufficient Storage\r\nContent-Length: 0\r\n\r\n")
    with pytest.raises(EnvdError, match="507"):
        await upload_stream(s, "/x", 3, _chunks(b"abc"))

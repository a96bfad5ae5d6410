"""HTTP/1.1 on the wire, by hand: the request head rebuilt from an ASGI scope, the response head and its
body framing parsed, chunked bodies decoded and encoded, with limits on what the sandbox side may send.

Pure functions over bytes, no I/O, so every edge of the format is tested without a stream. Written by
hand rather than through an HTTP library because re-encoding each request and response through one
(it was httpcore + h11) cost more CPU than the rest of the proxy hop together.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

# Hop-by-hop request headers, plus the framing and ``expect`` ones that the relay sets itself (the
# front server already answered any ``Expect: 100-continue``).
_DROP_REQUEST = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"upgrade", b"proxy-authorization",
        b"content-length", b"transfer-encoding", b"expect",
    }
)
_DROP_RESPONSE = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"trailer", b"upgrade", b"proxy-authenticate"}
)

MAX_HEAD = 64 * 1024  # response head (status line + headers) size limit
_MAX_LINE = 4096  # chunk-size and trailer lines
_HEAD_END = re.compile(rb"\r?\n\r?\n")

# Body lengths from response_framing() that are not a byte count.
UNTIL_EOF = -1
CHUNKED = -2
LAST_CHUNK = b"0\r\n\r\n"


class UpstreamError(Exception):
    """The sandbox side broke HTTP/1.1: closed early, or sent something unparseable."""


_TOKEN = re.compile(rb"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")


@functools.lru_cache(maxsize=1024)
def canonical_name(name: bytes) -> bytes:
    """``x-access-token`` → ``X-Access-Token``: the ASGI server hands header names lowercased, while
    E2B's proxy (Go's net/http) writes them in this canonical form, and servers in the sandbox that
    print the names they get (the SDK's mask_request_host test does) see what they see on E2B. A name
    that is not a plain token is passed as it is, as Go does."""
    if not _TOKEN.match(name):
        return name
    return b"-".join(part[:1].upper() + part[1:].lower() for part in name.split(b"-"))


def request_head(scope: Scope) -> tuple[bytes, str | None]:
    """The upstream request head and the body framing: None (no body), "length" or "chunked".

    A body the client sent chunked is re-chunked; one with a Content-Length keeps it.
    """
    path = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string")
    parts = [scope["method"].encode("latin-1"), b" ", path]
    if query:
        parts += [b"?", query]
    parts.append(b" HTTP/1.1\r\n")
    framing: str | None = None
    length = b""
    has_host = False
    for name, value in scope["headers"]:
        if name in _DROP_REQUEST:
            if name == b"transfer-encoding":
                framing = "chunked"
            elif name == b"content-length":
                length = value.strip()
            continue
        if name == b"host":
            has_host = True
        parts += [canonical_name(name), b": ", value, b"\r\n"]
    if framing is None and length:
        if length != b"0":
            framing = "length"
        parts += [b"Content-Length: ", length, b"\r\n"]  # kept at 0 too: some servers want it on a POST
    elif framing == "chunked":
        parts.append(b"Transfer-Encoding: chunked\r\n")
    if not has_host:
        parts.append(b"Host: sandbox\r\n")
    parts.append(b"\r\n")
    return b"".join(parts), framing


def frame_unsized_body(head: bytes, first: bytes, more: bool) -> tuple[bytes, str | None]:
    """``head`` (from :func:`request_head`, no framing) with the framing of a body the client framed itself
    (HTTP/2 DATA frames need no Content-Length) and its first piece ``first`` after it: sized when that
    piece is all of it, chunked when more follows, none when it is empty and last. Returns the bytes to
    write and the framing."""
    if more:
        return head[:-2] + b"Transfer-Encoding: chunked\r\n\r\n" + encode_chunk(first), "chunked"
    if first:
        return head[:-2] + b"Content-Length: %d\r\n\r\n" % len(first) + first, "length"
    return head, None


def encode_chunk(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked body; nothing for no data (an empty chunk would end the body)."""
    return b"%x\r\n%s\r\n" % (len(data), data) if data else b""


def take_head(buf: bytearray) -> bytes | None:
    """The response head (without its blank line), cut off the front of ``buf``; None while it is not all
    there yet. Raises UpstreamError once ``buf`` holds more than MAX_HEAD bytes without a head's end."""
    m = _HEAD_END.search(buf)
    if m is not None:
        head = bytes(buf[: m.start()])
        del buf[: m.end()]
        return head
    if len(buf) > MAX_HEAD:
        raise UpstreamError("response head too large")
    return None


def parse_response_head(head: bytes) -> tuple[int, bool, Headers, dict[bytes, bytes]]:
    """(status, HTTP/1.1?, headers to pass on, framing headers lowercased) from the bytes before the
    blank line. Raises UpstreamError on garbage."""
    lines = head.split(b"\n")
    status_line = lines[0].rstrip(b"\r")
    try:
        version, code = status_line.split(b" ", 2)[:2]
        status = int(code)
    except ValueError:
        raise UpstreamError(f"bad status line {status_line[:80]!r}") from None
    if not version.startswith(b"HTTP/1.") or not 100 <= status <= 999:
        raise UpstreamError(f"bad status line {status_line[:80]!r}")
    headers: Headers = []
    framing: dict[bytes, bytes] = {}
    for raw in lines[1:]:
        line = raw.rstrip(b"\r")
        if not line:
            continue
        name, sep, value = line.partition(b":")
        name = name.strip().lower()
        if not sep or not name or b" " in name:
            raise UpstreamError(f"bad header line {line[:80]!r}")
        value = value.strip()
        if name in _DROP_RESPONSE:
            if name in framing:
                framing[name] += b"," + value
            else:
                framing[name] = value
            continue
        if name == b"content-length":
            if name in framing and framing[name] != value:
                raise UpstreamError("conflicting content-length headers")
            framing[name] = value
        headers.append((name, value))
    return status, version == b"HTTP/1.1", headers, framing


def response_framing(method: str, status: int, headers: Headers, framing: dict[bytes, bytes]) -> tuple[int, Headers]:
    """How the response body is delimited: its length in bytes, CHUNKED or UNTIL_EOF; and the headers to
    pass on, less a Content-Length that does not describe the body the client will get."""
    if method == "HEAD" or status in (204, 304):
        if status in (204, 304):  # the server would expect a body of that length
            headers = [(k, v) for k, v in headers if k != b"content-length"]
        return 0, headers
    if b"transfer-encoding" in framing:
        length = UNTIL_EOF
        if framing[b"transfer-encoding"].lower().rsplit(b",", 1)[-1].strip() == b"chunked":
            length = CHUNKED
        return length, [(k, v) for k, v in headers if k != b"content-length"]
    if b"content-length" in framing:
        raw = framing[b"content-length"]
        if not raw.isdigit():
            raise UpstreamError(f"bad content-length {raw[:20]!r}")
        return int(raw), headers
    return UNTIL_EOF, headers


def keeps_alive(http11: bool, framing: dict[bytes, bytes]) -> bool:
    """Whether the response lets the connection carry another request (before its body is judged)."""
    return http11 and b"close" not in framing.get(b"connection", b"").lower()


class ChunkedDecoder:
    """Incremental decoder of a chunked body: ``feed`` takes what it can from ``buf`` and returns the data."""

    __slots__ = ("state", "remaining")

    def __init__(self) -> None:
        self.state = 0  # 0 size line, 1 data, 2 CRLF after data, 3 trailers, 4 done
        self.remaining = 0

    @property
    def done(self) -> bool:
        return self.state == 4

    def feed(self, buf: bytearray) -> bytes:
        out: list[bytes] = []
        while buf and self.state != 4:
            if self.state == 1:
                take = min(self.remaining, len(buf))
                out.append(bytes(buf[:take]))
                del buf[:take]
                self.remaining -= take
                if not self.remaining:
                    self.state = 2
                continue
            end = buf.find(b"\n")
            if end < 0:
                if len(buf) > _MAX_LINE:
                    raise UpstreamError("chunk line too long")
                break
            line = bytes(buf[:end]).rstrip(b"\r")
            del buf[: end + 1]
            if self.state == 0:
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise UpstreamError(f"bad chunk size {line[:40]!r}") from None
                if size < 0:
                    raise UpstreamError("negative chunk size")
                self.remaining = size
                self.state = 1 if size else 3
            elif self.state == 2:
                if line:
                    raise UpstreamError("missing CRLF after chunk")
                self.state = 0
            elif not line:  # state 3: trailers (dropped) end with an empty line
                self.state = 4
        return b"".join(out) if len(out) != 1 else out[0]

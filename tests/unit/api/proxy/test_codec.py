"""The HTTP/1.1 codec (codec.py): pure functions over bytes, so each edge of the format is tested here
without a stream."""

from __future__ import annotations

import pytest

from aenv.api.proxy import ChunkedDecoder, UpstreamError, parse_response_head, request_head
from aenv.api.proxy.codec import (
    _MAX_LINE,
    CHUNKED,
    MAX_HEAD,
    UNTIL_EOF,
    canonical_name,
    encode_chunk,
    frame_unsized_body,
    keeps_alive,
    response_framing,
    take_head,
)


def test_request_head_drops_hop_by_hop_and_keeps_framing() -> None:
    scope = {
        "method": "POST", "path": "/a b", "raw_path": b"/a%20b", "query_string": b"x=1&y=2",
        "headers": [(b"host", b"h"), (b"connection", b"keep-alive"), (b"expect", b"100-continue"),
                    (b"te", b"trailers"), (b"content-length", b"5"), (b"x-access-token", b"t")],
    }
    head, framing = request_head(scope)
    assert framing == "length"
    assert head == b"POST /a%20b?x=1&y=2 HTTP/1.1\r\nHost: h\r\nX-Access-Token: t\r\nContent-Length: 5\r\n\r\n"
    scope["headers"] = [(b"transfer-encoding", b"chunked"), (b"content-length", b"5")]
    head, framing = request_head(scope)
    assert framing == "chunked"
    assert head.endswith(b"Transfer-Encoding: chunked\r\nHost: sandbox\r\n\r\n") and b"content-length" not in head.lower()
    scope["headers"] = [(b"host", b"h"), (b"content-length", b"0")]
    head, framing = request_head(scope)
    assert framing is None and head.endswith(b"Content-Length: 0\r\n\r\n")


def test_parse_response_head() -> None:
    status, http11, headers, framing = parse_response_head(
        b"HTTP/1.1 200 OK\r\nContent-Type: a/b\r\nConnection: close\r\nTransfer-Encoding: chunked\r\nX-A:  1 \r\n"
    )
    assert (status, http11) == (200, True)
    assert headers == [(b"content-type", b"a/b"), (b"x-a", b"1")]
    assert framing == {b"connection": b"close", b"transfer-encoding": b"chunked"}
    assert parse_response_head(b"HTTP/1.0 404 Not Found\n")[:2] == (404, False)
    for bad in (b"SSH-2.0-OpenSSH", b"HTTP/1.1 abc", b"HTTP/1.1 200 OK\r\nno colon",
                b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2"):
        with pytest.raises(UpstreamError):
            parse_response_head(bad)


def test_chunked_decoder_any_split() -> None:
    wire = b"5;ext=1\r\nhello\r\n1\r\n \r\nA\r\n0123456789\r\n0\r\nTrailer: x\r\n\r\n"
    for step in (1, 2, 3, 7, len(wire)):
        dec, buf, out = ChunkedDecoder(), bytearray(), b""
        for i in range(0, len(wire), step):
            buf += wire[i : i + step]
            out += dec.feed(buf)
        assert dec.done and out == b"hello 0123456789" and not buf
    with pytest.raises(UpstreamError):
        ChunkedDecoder().feed(bytearray(b"zz\r\n"))



# ---- added with the split ---------------------------------------------------------------------------


def test_request_head_without_raw_path_query_or_body() -> None:
    scope = {"method": "GET", "path": "/p", "query_string": b"", "headers": [(b"x-a", b"1")]}
    assert request_head(scope) == (b"GET /p HTTP/1.1\r\nX-A: 1\r\nHost: sandbox\r\n\r\n", None)


def test_encode_chunk() -> None:
    assert encode_chunk(b"") == b""  # an empty chunk would end the body
    assert encode_chunk(b"x" * 26) == b"1a\r\n" + b"x" * 26 + b"\r\n"
    dec, buf = ChunkedDecoder(), bytearray(encode_chunk(b"hello") + encode_chunk(b"!") + b"0\r\n\r\n")
    assert dec.feed(buf) == b"hello!" and dec.done


def test_take_head_cuts_the_head_off_the_buffer() -> None:
    buf = bytearray(b"HTTP/1.1 200 OK\r\nx: 1\r\n")
    assert take_head(buf) is None and buf == b"HTTP/1.1 200 OK\r\nx: 1\r\n"  # not all there yet
    buf += b"\r\nbody"
    assert take_head(buf) == b"HTTP/1.1 200 OK\r\nx: 1" and buf == b"body"
    buf = bytearray(b"HTTP/1.0 200 OK\nx: 1\n\nrest")  # bare LF line ends
    assert take_head(buf) == b"HTTP/1.0 200 OK\nx: 1" and buf == b"rest"


def test_take_head_limit() -> None:
    assert take_head(bytearray(b"x" * MAX_HEAD)) is None
    with pytest.raises(UpstreamError, match="too large"):
        take_head(bytearray(b"x" * (MAX_HEAD + 1)))
    buf = bytearray(b"x" * MAX_HEAD + b"\r\n\r\n" + b"y" * 10)  # its end arrived with more: still a head
    assert take_head(buf) == b"x" * MAX_HEAD and buf == b"y" * 10


def test_parse_response_head_edges() -> None:
    assert parse_response_head(b"HTTP/1.1 999")[0] == 999  # no reason phrase
    for bad in (b"HTTP/1.1 99 Low", b"HTTP/1.1 1000 High", b"HTTP/2 200 OK", b"",
                b"HTTP/1.1 200 OK\r\nbad name: v", b"HTTP/1.1 200 OK\r\n: v"):
        with pytest.raises(UpstreamError):
            parse_response_head(bad)
    status, _, headers, framing = parse_response_head(
        b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\ncontent-length: 3\r\nCONTENT-LENGTH: 3\r\n"
        b"connection: close\r\nproxy-authenticate: x\r\n\r\n"
    )
    assert headers == [(b"content-length", b"3"), (b"content-length", b"3")]  # the same twice: allowed
    assert framing == {b"connection": b"keep-alive,close", b"content-length": b"3", b"proxy-authenticate": b"x"}


def test_response_framing() -> None:
    cl = [(b"content-length", b"5"), (b"x", b"1")]
    assert response_framing("HEAD", 200, cl, {b"content-length": b"5"}) == (0, cl)  # says the GET's length
    for status in (204, 304):
        assert response_framing("GET", status, cl, {b"content-length": b"5"}) == (0, [(b"x", b"1")])
    assert response_framing("GET", 200, cl, {b"transfer-encoding": b"gzip, Chunked"}) == (CHUNKED, [(b"x", b"1")])
    assert response_framing("GET", 200, cl, {b"transfer-encoding": b"chunked,gzip"}) == (UNTIL_EOF, [(b"x", b"1")])
    assert response_framing("GET", 200, cl, {b"content-length": b"5"}) == (5, cl)
    assert response_framing("GET", 200, [], {}) == (UNTIL_EOF, [])
    for bad in (b"-1", b"1e3", b"", b"0x10"):
        with pytest.raises(UpstreamError, match="bad content-length"):
            response_framing("GET", 200, [], {b"content-length": bad})


def test_keeps_alive() -> None:
    assert keeps_alive(True, {})
    assert keeps_alive(True, {b"connection": b"keep-alive"})
    assert not keeps_alive(True, {b"connection": b"keep-alive,Close"})
    assert not keeps_alive(False, {})


def test_chunked_decoder_edges() -> None:
    dec, buf = ChunkedDecoder(), bytearray()
    assert dec.feed(buf) == b"" and not dec.done
    buf = bytearray(b"A\n0123456789\n0\n\nnext response")  # bare LF, uppercase hex, bytes after the end
    assert dec.feed(buf) == b"0123456789" and dec.done and buf == b"next response"
    assert dec.feed(buf) == b"" and buf == b"next response"  # done: takes nothing more
    dec, buf = ChunkedDecoder(), bytearray(b"3\r\nab")  # a chunk split mid-data
    assert dec.feed(buf) == b"ab" and not dec.done and dec.remaining == 1
    for bad, why in ((b"-1\r\n", "negative"), (b"3\r\nabcX\r\n", "missing CRLF"), (b"\r\n", "bad chunk size")):
        with pytest.raises(UpstreamError, match=why):
            ChunkedDecoder().feed(bytearray(bad))


def test_chunked_decoder_line_limit() -> None:
    buf = bytearray(b"1" * _MAX_LINE)
    assert ChunkedDecoder().feed(buf) == b"" and len(buf) == _MAX_LINE  # waits for the line's end
    with pytest.raises(UpstreamError, match="too long"):
        ChunkedDecoder().feed(bytearray(b"1" * (_MAX_LINE + 1)))
    dec = ChunkedDecoder()  # trailer lines have the same limit
    assert dec.feed(bytearray(b"0\r\n")) == b""
    with pytest.raises(UpstreamError, match="too long"):
        dec.feed(bytearray(b"x-trailer: " + b"v" * _MAX_LINE))


def test_header_names_go_out_in_canonical_form_as_from_e2bs_proxy() -> None:
    assert canonical_name(b"x-access-token") == b"X-Access-Token"
    assert canonical_name(b"host") == b"Host" and canonical_name(b"www-AUTHENTICATE") == b"Www-Authenticate"
    assert canonical_name(b"bad name") == b"bad name"  # not a token: as it came
    head, _ = request_head({"method": "GET", "path": "/", "headers": [(b"host", b"h"), (b"user-agent", b"u")]})
    assert head == b"GET / HTTP/1.1\r\nHost: h\r\nUser-Agent: u\r\n\r\n"


def test_an_h2_body_without_content_length_gets_its_http11_framing_from_its_first_piece() -> None:
    head, framing = request_head({"method": "POST", "path": "/rpc", "headers": [(b"host", b"h")]})
    assert framing is None
    assert frame_unsized_body(head, b"", False) == (head, None)  # no body at all
    sized, framing = frame_unsized_body(head, b"abc", False)  # all of it in one piece
    assert (framing, sized) == ("length", b"POST /rpc HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\nabc")
    chunked, framing = frame_unsized_body(head, b"abc", True)  # more follows: a stream
    assert (framing, chunked) == ("chunked", b"POST /rpc HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
                                             b"3\r\nabc\r\n")  # fmt: skip

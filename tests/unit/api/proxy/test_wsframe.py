"""The WebSocket codec (wsframe.py): handshake keys, frames both ways checked against an independent
implementation (the ``websockets`` package's frame parser and serializer), message reassembly, close
codes, and every protocol violation a sandbox could send.
"""

from __future__ import annotations

import os
import struct

import pytest
from websockets.frames import Frame, Opcode
from websockets.streams import StreamReader

from aenv.api.proxy import wsframe as w


def _theirs(data: bytes, mask: bool) -> Frame:
    """``data`` parsed by the websockets package (as a server parses a client's frame when ``mask``)."""
    reader = StreamReader()
    reader.feed_data(data)
    parser = Frame.parse(reader.read_exact, mask=mask)
    try:
        next(parser)
    except StopIteration as stop:
        frame: Frame = stop.value
        return frame
    raise AssertionError("incomplete frame")


def _server_frame(opcode: Opcode, data: bytes, fin: bool = True) -> bytes:
    return Frame(opcode, data, fin).serialize(mask=False)


def test_accept_key_is_the_rfc_example() -> None:
    assert w.accept_for(b"dGhlIHNhbXBsZSBub25jZQ==") == b"s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
    assert len(w.new_key()) == 24 and w.new_key() != w.new_key()


@pytest.mark.parametrize("size", [0, 1, 125, 126, 65535, 65536, 1 << 20])
def test_client_frames_parse_as_the_websockets_package_parses_them(size: int) -> None:
    payload = os.urandom(size)
    raw = w.encode_frame(w.BINARY, payload)
    assert raw[1] & 0x80  # masked, as a client must
    frame = _theirs(raw, mask=True)
    assert (frame.opcode, frame.data, frame.fin) == (Opcode.BINARY, payload, True)


def test_mask_is_an_involution_and_matches_a_plain_xor() -> None:
    data, key = os.urandom(1001), b"\x01\x80\xff\x10"
    assert w.apply_mask(data, key) == bytes(b ^ key[i % 4] for i, b in enumerate(data))
    assert w.apply_mask(w.apply_mask(data, key), key) == data
    assert w.apply_mask(b"", key) == b""


@pytest.mark.parametrize("size", [0, 125, 126, 65535, 65536, 300_000])
def test_server_frames_decode_fed_at_once_and_byte_by_byte(size: int) -> None:
    payload = os.urandom(size)
    raw = _server_frame(Opcode.BINARY, payload) + _server_frame(Opcode.TEXT, "héllo".encode())
    assert w.FrameDecoder(1 << 20).feed(raw) == [w.Message(payload), w.Message("héllo")]
    dec = w.FrameDecoder(1 << 20)
    events: list[w.Event] = []
    step = 1 if size < 1000 else 4093
    for i in range(0, len(raw), step):
        events += dec.feed(raw[i : i + step])
    assert events == [w.Message(payload), w.Message("héllo")]


def test_fragments_are_reassembled_around_control_frames() -> None:
    raw = (_server_frame(Opcode.TEXT, b"ab", fin=False) + _server_frame(Opcode.PING, b"p1")
           + _server_frame(Opcode.CONT, b"cd", fin=False) + _server_frame(Opcode.CONT, b"ef")
           + _server_frame(Opcode.PONG, b"p2"))  # fmt: skip
    assert w.FrameDecoder(100).feed(raw) == [w.Ping(b"p1"), w.Message("abcdef"), w.Pong(b"p2")]


def test_a_masked_server_frame_is_unmasked() -> None:
    raw = Frame(Opcode.TEXT, b"masked anyway").serialize(mask=True)
    assert w.FrameDecoder(100).feed(raw) == [w.Message("masked anyway")]


def test_close_frames() -> None:
    dec = w.FrameDecoder(100)
    assert dec.feed(_server_frame(Opcode.CLOSE, struct.pack("!H", 4001) + b"bye") + b"ignored after close") == [
        w.Close(4001, "bye")
    ]
    assert dec.feed(_server_frame(Opcode.TEXT, b"late")) == []
    assert w.FrameDecoder(100).feed(_server_frame(Opcode.CLOSE, b"")) == [w.Close(w.NO_STATUS, "")]


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (bytes([0xC1, 0x00]), w.PROTOCOL_ERROR),  # RSV1 (compression) was never negotiated
        (bytes([0x83, 0x00]), w.PROTOCOL_ERROR),  # reserved opcode
        (bytes([0x09, 0x00]), w.PROTOCOL_ERROR),  # fragmented ping
        (bytes([0x89, 126, 0, 126]) + b"x" * 126, w.PROTOCOL_ERROR),  # control frame over 125 bytes
        (bytes([0x80, 0x01]) + b"x", w.PROTOCOL_ERROR),  # continuation with no message
        (bytes([0x01, 0x01]) + b"a" + bytes([0x81, 0x01]) + b"b", w.PROTOCOL_ERROR),  # message inside a message
        (bytes([0x82, 127]) + struct.pack("!Q", 1 << 63), w.PROTOCOL_ERROR),  # length's top bit
        (bytes([0x81, 0x02]) + b"\xc3\x28", w.INVALID_DATA),  # text that is not UTF-8
        (bytes([0x88, 0x01]) + b"x", w.PROTOCOL_ERROR),  # close frame of one byte
        (bytes([0x88, 0x02]) + struct.pack("!H", 1005), w.PROTOCOL_ERROR),  # a code that never travels
        (bytes([0x88, 0x02]) + struct.pack("!H", 999), w.PROTOCOL_ERROR),
        (bytes([0x88, 0x04]) + struct.pack("!H", 1000) + b"\xc3\x28", w.INVALID_DATA),  # reason not UTF-8
    ],
)
def test_protocol_violations_name_their_close_code(raw: bytes, code: int) -> None:
    with pytest.raises(w.WsProtocolError) as err:
        w.FrameDecoder(1 << 20).feed(raw)
    assert err.value.code == code


def test_a_message_over_the_limit_is_refused_before_its_payload_arrives() -> None:
    dec = w.FrameDecoder(1000)
    assert dec.feed(_server_frame(Opcode.TEXT, b"x" * 600, fin=False)) == []
    with pytest.raises(w.WsProtocolError) as err:
        dec.feed(bytes([0x80, 126]) + struct.pack("!H", 401))  # the header alone is enough
    assert err.value.code == w.TOO_BIG
    with pytest.raises(w.WsProtocolError):
        w.FrameDecoder(1000).feed(bytes([0x82, 127]) + struct.pack("!Q", 1 << 40))


def test_close_payloads() -> None:
    assert w.close_payload(w.NO_STATUS) == b"" and w.close_payload(1006) == b""
    assert w.close_payload(4000, "why") == struct.pack("!H", 4000) + b"why"
    long = w.close_payload(1000, "é" * 100)  # 200 bytes of reason, cut at 123 without splitting a character
    assert len(long) <= 125 and long[2:].decode() == "é" * 61
    assert w.sendable(1000) and w.sendable(4999) and not w.sendable(1005) and not w.sendable(1015)


def test_upgrade_request_keeps_the_clients_headers_but_not_its_handshake() -> None:
    scope = {
        "path": "/ws", "raw_path": b"/ws%20x", "query_string": b"a=1",
        "headers": [(b"host", b"8000-abc.localhost:8000"), (b"sec-websocket-key", b"client-key"),
                    (b"sec-websocket-version", b"13"), (b"sec-websocket-extensions", b"permessage-deflate"),
                    (b"sec-websocket-protocol", b"chat, v2"), (b"cookie", b"a=b"), (b"connection", b"Upgrade"),
                    (b"upgrade", b"websocket")],
    }  # fmt: skip
    head = w.upgrade_request(scope, b"my-key")
    lines = head.split(b"\r\n")
    assert lines[0] == b"GET /ws%20x?a=1 HTTP/1.1" and head.endswith(b"\r\n\r\n")
    assert b"host: 8000-abc.localhost:8000" in lines and b"cookie: a=b" in lines
    assert b"sec-websocket-protocol: chat, v2" in lines and b"sec-websocket-key: my-key" in lines
    assert b"client-key" not in head and b"permessage-deflate" not in head
    assert head.lower().count(b"upgrade: websocket") == 1 and head.count(b"sec-websocket-version") == 1
    assert b"host: sandbox" in w.upgrade_request({"path": "/", "headers": []}, b"k")


def test_check_upgrade() -> None:
    key = w.new_key()
    framing = {b"upgrade": b"WebSocket", b"connection": b"keep-alive, Upgrade"}
    headers = [(b"sec-websocket-accept", w.accept_for(key)), (b"sec-websocket-protocol", b"v2"),
               (b"set-cookie", b"s=1"), (b"date", b"today")]  # fmt: skip
    assert w.check_upgrade(key, headers, framing) == ("v2", [(b"set-cookie", b"s=1")])
    assert w.check_upgrade(key, headers[:1], framing) == (None, [])
    bad = [
        (headers, {b"connection": b"upgrade"}),
        (headers, {b"upgrade": b"websocket"}),
        ([(b"sec-websocket-accept", b"wrong")], framing),
        ([*headers, (b"sec-websocket-extensions", b"permessage-deflate")], framing),
    ]
    for hs, fr in bad:
        with pytest.raises(w.WsProtocolError):
            w.check_upgrade(key, hs, fr)


def test_events_before_a_fault_are_kept_on_the_error() -> None:
    raw = _server_frame(Opcode.TEXT, b"first") + _server_frame(Opcode.PING, b"p") + bytes([0xC1, 0x00])
    dec = w.FrameDecoder(100)
    with pytest.raises(w.WsProtocolError) as err:
        dec.feed(raw)
    assert err.value.events == [w.Message("first"), w.Ping(b"p")]
    assert dec.feed(_server_frame(Opcode.TEXT, b"after")) == []  # a broken stream decodes nothing more

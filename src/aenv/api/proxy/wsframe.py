"""WebSocket (RFC 6455) on the wire, by hand: the proxy's side of the upgrade handshake with the sandbox,
frames encoded and decoded, messages reassembled, and the close codes that may travel.

The front server (uvicorn) speaks WebSocket with the client and hands the proxy whole messages (ASGI
``websocket`` scope); towards the sandbox the proxy is the WebSocket client, over one mux stream. Pure
functions over bytes and one incremental decoder, no I/O, so every edge of the format is tested without a
stream; a library was not used so that this hop depends on no WebSocket package's API (they change between
majors) and does only what the relay needs: no extensions are offered to the sandbox, so no RSV bit is
legal.
"""

from __future__ import annotations

import base64
import hashlib
import os
import struct
from dataclasses import dataclass

from .codec import Headers, Scope

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

CONT, TEXT, BINARY, CLOSE, PING, PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
_DATA = frozenset({CONT, TEXT, BINARY})
_CONTROL = frozenset({CLOSE, PING, PONG})

# Close codes (RFC 6455 §7.4).
NORMAL, GOING_AWAY, PROTOCOL_ERROR, NO_STATUS, INVALID_DATA, TOO_BIG = 1000, 1001, 1002, 1005, 1007, 1009
_WIRE_CODES = frozenset({1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014})

# Request headers the proxy sets itself on the upgrade towards the sandbox (hop-by-hop ones, and the
# handshake's own: a fresh key, and no extensions, which this hop does not implement).
_DROP_UPGRADE_REQUEST = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"upgrade", b"proxy-authorization",
        b"content-length", b"transfer-encoding", b"expect", b"sec-websocket-key", b"sec-websocket-version",
        b"sec-websocket-extensions", b"sec-websocket-accept",
    }
)  # fmt: skip
# 101 headers that describe the sandbox hop's handshake, or that the front server writes itself.
_DROP_UPGRADE_RESPONSE = frozenset(
    {b"sec-websocket-accept", b"sec-websocket-protocol", b"sec-websocket-extensions", b"content-length", b"date",
     b"server"}
)  # fmt: skip


class WsProtocolError(Exception):
    """The sandbox side broke RFC 6455; ``code`` is the close code that says how. ``events`` are the ones the
    same ``feed`` decoded before the fault: they are still to be delivered."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason
        self.events: list[Event] = []


@dataclass(frozen=True, slots=True)
class Message:
    data: str | bytes  # str for a text message


@dataclass(frozen=True, slots=True)
class Ping:
    payload: bytes


@dataclass(frozen=True, slots=True)
class Pong:
    payload: bytes


@dataclass(frozen=True, slots=True)
class Close:
    code: int  # NO_STATUS when the frame carried none
    reason: str


Event = Message | Ping | Pong | Close


def new_key() -> bytes:
    return base64.b64encode(os.urandom(16))


def accept_for(key: bytes) -> bytes:
    """The ``Sec-WebSocket-Accept`` a server must answer to ``key``."""
    return base64.b64encode(hashlib.sha1(key.strip() + GUID).digest())  # noqa: S324 - the RFC's digest


def upgrade_request(scope: Scope, key: bytes) -> bytes:
    """The upgrade request towards the sandbox, from a ``websocket`` scope: the client's path, query and
    headers (subprotocols and cookies included), this hop's own key, no extensions."""
    path = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string")
    parts = [b"GET ", path, b"?" + query if query else b"", b" HTTP/1.1\r\n"]
    has_host = False
    for name, value in scope["headers"]:
        if name in _DROP_UPGRADE_REQUEST:
            continue
        has_host = has_host or name == b"host"
        parts += [name, b": ", value, b"\r\n"]
    if not has_host:
        parts.append(b"host: sandbox\r\n")
    parts += [b"upgrade: websocket\r\nconnection: Upgrade\r\nsec-websocket-version: 13\r\nsec-websocket-key: ",
              key, b"\r\n\r\n"]  # fmt: skip
    return b"".join(parts)


def check_upgrade(key: bytes, headers: Headers, framing: dict[bytes, bytes]) -> tuple[str | None, Headers]:
    """(the subprotocol the sandbox chose, the headers to pass on to the client) from a 101 response.
    Raises WsProtocolError when it is not a WebSocket handshake answering ``key``."""
    if b"websocket" not in [t.strip() for t in framing.get(b"upgrade", b"").lower().split(b",")]:
        raise WsProtocolError(PROTOCOL_ERROR, "101 without Upgrade: websocket")
    if b"upgrade" not in [t.strip() for t in framing.get(b"connection", b"").lower().split(b",")]:
        raise WsProtocolError(PROTOCOL_ERROR, "101 without Connection: upgrade")
    found = dict(headers)
    if found.get(b"sec-websocket-accept", b"").strip() != accept_for(key):
        raise WsProtocolError(PROTOCOL_ERROR, "wrong Sec-WebSocket-Accept")
    if found.get(b"sec-websocket-extensions", b"").strip():
        raise WsProtocolError(PROTOCOL_ERROR, "an extension that was not offered")
    chosen = found.get(b"sec-websocket-protocol", b"").strip().decode("latin-1") or None
    return chosen, [(k, v) for k, v in headers if k not in _DROP_UPGRADE_RESPONSE]


def apply_mask(data: bytes, key: bytes) -> bytes:
    """``data`` XOR the 4-byte ``key`` repeated (masking and unmasking are the same). One big-integer XOR:
    linear and in C, ~100x faster than a loop over bytes."""
    n = len(data)
    if not n:
        return b""
    stream = (key * (n // 4 + 1))[:n]
    return (int.from_bytes(data, "little") ^ int.from_bytes(stream, "little")).to_bytes(n, "little")


def encode_frame(opcode: int, payload: bytes, mask: bool = True, fin: bool = True) -> bytes:
    """One frame; a client's (``mask``) carries a fresh random masking key."""
    n = len(payload)
    first = (0x80 if fin else 0) | opcode
    bit = 0x80 if mask else 0
    if n < 126:
        head = struct.pack("!BB", first, bit | n)
    elif n < 1 << 16:
        head = struct.pack("!BBH", first, bit | 126, n)
    else:
        head = struct.pack("!BBQ", first, bit | 127, n)
    if not mask:
        return head + payload
    key = os.urandom(4)
    return head + key + apply_mask(payload, key)


def close_payload(code: int, reason: str = "") -> bytes:
    """The body of a close frame: empty for NO_STATUS, else the code and at most 123 bytes of reason."""
    if code == NO_STATUS or not sendable(code):
        return b""
    raw = reason.encode()[:123]
    return struct.pack("!H", code) + raw.decode(errors="ignore").encode()


def sendable(code: int) -> bool:
    """Whether a close frame may carry ``code`` (1005, 1006, 1015 and unassigned ones may not)."""
    return code in _WIRE_CODES or 3000 <= code < 5000


def parse_close(payload: bytes) -> Close:
    if not payload:
        return Close(NO_STATUS, "")
    if len(payload) < 2:
        raise WsProtocolError(PROTOCOL_ERROR, "close frame of one byte")
    (code,) = struct.unpack("!H", payload[:2])
    if not sendable(code):
        raise WsProtocolError(PROTOCOL_ERROR, f"invalid close code {code}")
    try:
        reason = payload[2:].decode()
    except UnicodeDecodeError:
        raise WsProtocolError(INVALID_DATA, "close reason is not UTF-8") from None
    return Close(code, reason)


class FrameDecoder:
    """Incremental decoder of the frames a sandbox sends: ``feed`` returns whole messages (fragments
    reassembled) and control frames as they complete. Masked frames are unmasked (a server must not mask,
    but nothing is gained by refusing). A message larger than ``max_message`` is refused before its
    payload is buffered."""

    __slots__ = ("max_message", "_buf", "_head", "_pieces", "_remaining", "_message", "_message_size", "_closed")

    def __init__(self, max_message: int) -> None:
        self.max_message = max_message
        self._buf = bytearray()
        self._head: tuple[bool, int, bytes | None] | None = None  # (fin, opcode, mask key) of the frame in hand
        self._pieces: list[bytes] = []  # payload of the frame in hand so far
        self._remaining = 0
        self._message: tuple[int, list[bytes]] | None = None  # (opcode, payloads) of a fragmented message
        self._message_size = 0
        self._closed = False

    def feed(self, data: bytes) -> list[Event]:
        if self._closed:
            return []
        self._buf += data
        events: list[Event] = []
        try:
            while True:
                if self._head is None and not self._read_head():
                    break
                take = min(self._remaining, len(self._buf))
                if take:
                    self._pieces.append(bytes(self._buf[:take]))
                    del self._buf[:take]
                    self._remaining -= take
                if self._remaining:
                    break
                event = self._frame_done()
                if event is not None:
                    events.append(event)
                    if isinstance(event, Close):
                        self._closed = True  # nothing may follow a close frame
                        break
        except WsProtocolError as exc:
            self._closed = True
            exc.events = events
            raise
        return events

    def _read_head(self) -> bool:
        buf = self._buf
        if len(buf) < 2:
            return False
        b0, b1 = buf[0], buf[1]
        fin, opcode, masked, n = bool(b0 & 0x80), b0 & 0x0F, bool(b1 & 0x80), b1 & 0x7F
        if b0 & 0x70:
            raise WsProtocolError(PROTOCOL_ERROR, "reserved bits set (no extension was negotiated)")
        if opcode not in _DATA and opcode not in _CONTROL:
            raise WsProtocolError(PROTOCOL_ERROR, f"unknown opcode {opcode:#x}")
        if opcode in _CONTROL and (not fin or n > 125):
            raise WsProtocolError(PROTOCOL_ERROR, "fragmented or oversized control frame")
        at = 2
        if n == 126:
            if len(buf) < 4:
                return False
            (n,) = struct.unpack_from("!H", buf, 2)
            at = 4
        elif n == 127:
            if len(buf) < 10:
                return False
            (n,) = struct.unpack_from("!Q", buf, 2)
            if n >> 63:
                raise WsProtocolError(PROTOCOL_ERROR, "frame length has its top bit set")
            at = 10
        key = None
        if masked:
            if len(buf) < at + 4:
                return False
            key = bytes(buf[at : at + 4])
            at += 4
        if opcode in _DATA:
            if opcode == CONT and self._message is None:
                raise WsProtocolError(PROTOCOL_ERROR, "continuation frame outside a message")
            if opcode != CONT and self._message is not None:
                raise WsProtocolError(PROTOCOL_ERROR, "new message inside a fragmented one")
            size = (self._message_size if opcode == CONT else 0) + n
            if size > self.max_message:
                raise WsProtocolError(TOO_BIG, f"message of more than {self.max_message} bytes")
        del buf[:at]
        self._head = (fin, opcode, key)
        self._remaining = n
        return True

    def _frame_done(self) -> Event | None:
        assert self._head is not None
        fin, opcode, key = self._head
        payload = self._pieces[0] if len(self._pieces) == 1 else b"".join(self._pieces)
        self._head, self._pieces = None, []
        if key is not None:
            payload = apply_mask(payload, key)
        if opcode == PING:
            return Ping(payload)
        if opcode == PONG:
            return Pong(payload)
        if opcode == CLOSE:
            return parse_close(payload)
        if self._message is None:
            self._message, self._message_size = (opcode, [payload]), len(payload)
        else:
            self._message[1].append(payload)
            self._message_size += len(payload)
        if not fin:
            return None
        kind, parts = self._message
        self._message, self._message_size = None, 0
        whole = parts[0] if len(parts) == 1 else b"".join(parts)
        if kind == BINARY:
            return Message(whole)
        try:
            return Message(whole.decode())
        except UnicodeDecodeError:
            raise WsProtocolError(INVALID_DATA, "text message is not UTF-8") from None

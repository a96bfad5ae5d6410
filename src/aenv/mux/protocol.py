"""Wire format of the mux: fixed 12-byte frame headers, bounded payloads.

Frame::

    +--------+--------+----------------+--------------------------------+--------------------------------+
    | type u8| flags u8| reserved u16  | stream id u32 (big-endian)     | payload length u32 (big-endian)|
    +--------+--------+----------------+--------------------------------+--------------------------------+
    | payload (length bytes, at most MAX_PAYLOAD)                                                          |

Types (O = the opening side, usually the host; A = the accepting side, the in-sandbox agent):

    HELLO     both   first frame on a fresh channel; payload = protocol version (u16), then optional bytes
                     for the receiver's ``on_hello`` (the vm host sends its wall time and fresh random
                     bytes, applied by the guest before any stream of the session). Resets all streams.
    OPEN      O→A    open a stream to TCP port (payload u16) inside the sandbox
    OPEN_OK   A→O    the port answered; data may flow
    OPEN_ERR  A→O    payload = utf-8 reason; the stream is gone
    DATA      both   payload = bytes; never more than the peer's remaining window
    EOF       both   the sender will send no more data on this stream (half close)
    CLOSE     both   the stream is gone in both directions (reset); no answer expected
    WINDOW    both   payload u32: the receiver consumed that many more bytes (flow-control credit)
    PING/PONG both   payload echoed; liveness checks

Flow control is per stream: each side may have at most WINDOW_SIZE unacknowledged bytes in flight,
so one slow consumer never blocks the other streams sharing the channel.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

VERSION = 1
HEADER = struct.Struct("!BBHII")
HEADER_SIZE = HEADER.size
MAX_PAYLOAD = 64 * 1024
WINDOW_SIZE = 512 * 1024


class MuxError(Exception):
    """Root of the mux's errors."""


class ProtocolError(MuxError):
    """The peer sent something that breaks the wire format. Keeps the offending bytes for logs."""

    def __init__(self, message: str, raw: bytes = b"") -> None:
        super().__init__(message)
        self.raw = raw[:64]


class FrameType(enum.IntEnum):
    HELLO = 0
    OPEN = 1
    OPEN_OK = 2
    OPEN_ERR = 3
    DATA = 4
    EOF = 5
    CLOSE = 6
    WINDOW = 7
    PING = 8
    PONG = 9


@dataclass(frozen=True, slots=True)
class Frame:
    type: FrameType
    stream_id: int
    payload: bytes = b""

    def encode(self) -> bytes:
        if len(self.payload) > MAX_PAYLOAD:
            raise ProtocolError(f"payload of {len(self.payload)} bytes exceeds {MAX_PAYLOAD}")
        return HEADER.pack(self.type, 0, 0, self.stream_id, len(self.payload)) + self.payload


def decode_header(raw: bytes) -> tuple[FrameType, int, int]:
    """Parse a header into (type, stream id, payload length), rejecting unknown types and oversize frames."""
    if len(raw) != HEADER_SIZE:
        raise ProtocolError("short frame header", raw)
    kind, _flags, _reserved, stream_id, length = HEADER.unpack(raw)
    try:
        ftype = FrameType(kind)
    except ValueError:
        raise ProtocolError(f"unknown frame type {kind}", raw) from None
    if length > MAX_PAYLOAD:
        raise ProtocolError(f"frame payload length {length} exceeds {MAX_PAYLOAD}", raw)
    return ftype, stream_id, length


def u16(value: int) -> bytes:
    return struct.pack("!H", value)


def u32(value: int) -> bytes:
    return struct.pack("!I", value)


def parse_u16(payload: bytes) -> int:
    if len(payload) != 2:
        raise ProtocolError("expected a 2-byte payload", payload)
    return int(struct.unpack("!H", payload)[0])


def parse_hello(payload: bytes) -> tuple[int, bytes]:
    """(protocol version, extension bytes) of a HELLO payload."""
    if len(payload) < 2:
        raise ProtocolError("HELLO without a version", payload)
    return int(struct.unpack_from("!H", payload)[0]), payload[2:]


def parse_u32(payload: bytes) -> int:
    if len(payload) != 4:
        raise ProtocolError("expected a 4-byte payload", payload)
    return int(struct.unpack("!I", payload)[0])


HELLO_MAX_PAYLOAD = 4096  # a version and a small JSON extension (the vm host's clock and seed)


def starts_with_hello(data: bytes) -> bool | None:
    """Whether ``data`` begins with a HELLO frame: True, False, or None while too short to tell.

    A HELLO is a header of type 0, no flags, stream 0 and a 2..HELLO_MAX_PAYLOAD byte payload,
    which is VERSION and then, if anything, a JSON object. At most 15 bytes decide."""
    if any(data[:8]):
        return False
    if len(data) < HEADER_SIZE:
        return None
    length = int.from_bytes(data[8:12], "big")
    if not 2 <= length <= HELLO_MAX_PAYLOAD:
        return False
    if len(data) < HEADER_SIZE + 2:
        return None
    if data[12:14] != u16(VERSION):
        return False
    if length == 2:
        return True
    if len(data) < HEADER_SIZE + 3:
        return None
    return data[14:15] == b"{"

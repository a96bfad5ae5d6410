"""What the egress proxy reads off a connection's first bytes: the host name it is for (TLS SNI or
HTTP Host), and the one DNS exchange it makes itself (an A query). Pure byte parsing, no I/O."""

from __future__ import annotations

import ipaddress
import secrets
import struct

MAX_PEEK = 16 * 1024 + 5  # one TLS record, or an HTTP request head


class NeedMore(Exception):
    """Not enough bytes yet to tell."""


def host_name(data: bytes) -> str | None:
    """The host name ``data`` (the start of a connection) is for; None if it names none (not TLS or
    HTTP, no SNI, no Host). Raises NeedMore while it could still name one."""
    if not data:
        raise NeedMore
    if data[0] == 0x16:
        return _sni(data)
    return _http_host(data)


def _sni(data: bytes) -> str | None:
    if len(data) < 5:
        raise NeedMore
    length = struct.unpack_from("!H", data, 3)[0]
    if len(data) < 5 + length:
        if 5 + length > MAX_PEEK:
            return None
        raise NeedMore
    rec = data[5 : 5 + length]
    try:
        if rec[0] != 0x01:  # ClientHello
            return None
        pos = 4 + 2 + 32  # handshake header, client version, random
        pos += 1 + rec[pos]  # session id
        pos += 2 + struct.unpack_from("!H", rec, pos)[0]  # cipher suites
        pos += 1 + rec[pos]  # compression methods
        end = pos + 2 + struct.unpack_from("!H", rec, pos)[0]
        pos += 2
        while pos + 4 <= min(end, len(rec)):
            ext, size = struct.unpack_from("!HH", rec, pos)
            pos += 4
            if ext == 0:  # server_name: list length, then (type, length, name) entries
                inner = pos + 2
                while inner + 3 <= pos + size:
                    kind, n = rec[inner], struct.unpack_from("!H", rec, inner + 1)[0]
                    if kind == 0:
                        return rec[inner + 3 : inner + 3 + n].decode("ascii").lower()
                    inner += 3 + n
                return None
            pos += size
    except (IndexError, struct.error, UnicodeDecodeError):
        return None
    return None


def _http_host(data: bytes) -> str | None:
    end = data.find(b"\r\n\r\n")
    if end < 0:
        if len(data) >= MAX_PEEK or (len(data) >= 8 and b" " not in data[:16]):
            return None
        raise NeedMore
    lines = data[:end].split(b"\r\n")
    if len(lines[0].split(b" ")) != 3 or not lines[0].endswith((b"HTTP/1.1", b"HTTP/1.0")):
        return None
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"host":
            host = value.strip().decode("latin-1").lower()
            if host.startswith("["):
                return None  # an IPv6 literal names no domain
            return host.rsplit(":", 1)[0] if ":" in host else host
    return None


def a_query(name: str) -> tuple[int, bytes]:
    """(id, a DNS query for the A records of ``name``)."""
    qid = secrets.randbits(16)
    labels = b"".join(bytes([len(p)]) + p.encode("ascii") for p in name.rstrip(".").split("."))
    return qid, struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + labels + b"\0" + struct.pack("!HH", 1, 1)


def a_answers(qid: int, reply: bytes) -> list[str]:
    """The IPv4 addresses in ``reply`` to query ``qid`` (CNAMEs are followed by the server: its A
    records come in the same answer). Empty for an error, a mismatch or garbage."""
    try:
        rid, flags, qd, an = struct.unpack_from("!HHHH", reply, 0)
        if rid != qid or flags & 0x8000 == 0 or flags & 0x000F:
            return []
        pos = 12
        for _ in range(qd):
            pos = _skip_name(reply, pos) + 4
        out: list[str] = []
        for _ in range(an):
            pos = _skip_name(reply, pos)
            rtype, rclass, _ttl, size = struct.unpack_from("!HHIH", reply, pos)
            pos += 10
            if rtype == 1 and rclass == 1 and size == 4:
                out.append(str(ipaddress.IPv4Address(reply[pos : pos + 4])))
            pos += size
        return out
    except (struct.error, IndexError, ValueError):
        return []


def _skip_name(msg: bytes, pos: int) -> int:
    while True:
        n = msg[pos]
        if n == 0:
            return pos + 1
        if n & 0xC0 == 0xC0:
            return pos + 2
        pos += 1 + n

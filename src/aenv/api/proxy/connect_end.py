"""A Connect server stream whose sandbox went away mid-stream ends as E2B's does: with an end-of-stream
error ``unavailable`` ("the connection to sandbox … ended before the stream completed"), not a cut
connection.

The SDKs treat that answer as "maybe gone": they probe the sandbox's ``/health``, and when the proxy
says it was not found (killed, expired, paused) they raise the "killed or reached its end of life
while the request was in flight" error (Python: ``SandboxNotRunningException``). A cut chunked body
reaches them as a transport read error instead. :class:`ConnectStreamEnd` wraps the ASGI ``send`` of a
Connect streaming call, passes every message on, and follows the envelopes of the response body
(1 flag byte, 4-byte big-endian length, payload), so it can tell whether the body stopped between two
envelopes: only then can an end-of-stream envelope follow (mid-envelope, the connection is cut as
before). Over HTTP/2 the proxy uses none of this: the stream is reset instead (``cli/tls_serve.py``), the
transport failure on which every SDK version probes (2.45, for one, probes on nothing else). Behind a
gateway the client's HTTP/2 is the gateway's to see: it says so with ``X-Aenv-Client-H2`` (taken off the
request here), so the node cuts its connection to the gateway and the gateway resets the client's stream.
"""

from __future__ import annotations

import json
from typing import Any

from .codec import Message, Scope, Send

CONNECT_STREAM = b"application/connect+json"
_END_STREAM = 0x02
_PREFIX = 5


CLIENT_H2_HEADER = b"x-aenv-client-h2"  # set by a gateway whose client speaks HTTP/2


def client_speaks_h2(scope: Scope) -> tuple[Scope, bool]:
    """Whether the client is on HTTP/2 (here, or at the gateway that relays it), and the scope without
    the gateway's header."""
    if not any(k == CLIENT_H2_HEADER for k, _ in scope["headers"]):
        return scope, scope.get("http_version") == "2"
    return {**scope, "headers": [(k, v) for k, v in scope["headers"] if k != CLIENT_H2_HEADER]}, True


def _is_connect_stream(headers: Any) -> bool:
    return any(k.lower() == b"content-type" and v.split(b";")[0].strip().lower() == CONNECT_STREAM
               for k, v in headers)


class ConnectStreamEnd:
    __slots__ = ("_send", "_connect", "_prefix", "_need", "_closed")

    def __init__(self, send: Send) -> None:
        self._send = send
        self._connect = False  # the response is a Connect stream
        self._prefix = bytearray()  # an envelope prefix that arrived in pieces
        self._need = 0  # payload bytes of the current envelope still to come
        self._closed = False  # the body ended, or carried its own end-of-stream envelope

    @staticmethod
    def applies_to(scope: Scope) -> bool:
        """Whether the request is a Connect streaming call (the only ones wrapped)."""
        return _is_connect_stream(scope["headers"])

    async def __call__(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self._connect = _is_connect_stream(message.get("headers", ()))
        elif kind == "http.response.body" and self._connect and not self._closed:
            self._follow(message.get("body", b""))
            if not message.get("more_body", False):
                self._closed = True
        await self._send(message)

    def _follow(self, data: bytes) -> None:
        i, n = 0, len(data)
        while i < n:
            if self._need:
                take = min(self._need, n - i)
                self._need -= take
                i += take
                continue
            take = min(_PREFIX - len(self._prefix), n - i)
            self._prefix += data[i : i + take]
            i += take
            if len(self._prefix) == _PREFIX:
                if self._prefix[0] & _END_STREAM:
                    self._closed = True  # envd ended the stream itself: nothing may follow
                self._need = int.from_bytes(self._prefix[1:], "big")
                self._prefix.clear()

    async def end_unavailable(self, message: str) -> bool:
        """End the stream with an ``unavailable`` end-of-stream error, if it broke off between two
        envelopes of a Connect stream that had not ended. Returns whether it did."""
        if not self._connect or self._closed or self._need or self._prefix:
            return False
        self._closed = True
        payload = json.dumps({"error": {"code": "unavailable", "message": message}}).encode()
        envelope = bytes([_END_STREAM]) + len(payload).to_bytes(4, "big") + payload
        await self._send({"type": "http.response.body", "body": envelope, "more_body": False})
        return True

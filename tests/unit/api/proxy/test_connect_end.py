"""A response whose sandbox breaks off is cut (connect_end.py), a Connect stream wherever it broke (even
between two envelopes: the SDKs probe on the cut), any other response too."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.unit.api.proxy.helpers import Exchange, Handler, Rig, read_request

CONNECT = [(b"content-type", b"application/connect+json")]


def envelope(obj: object, flags: int = 0) -> bytes:
    data = json.dumps(obj).encode()
    return bytes([flags]) + len(data).to_bytes(4, "big") + data


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def dies_after(*pieces: bytes, content_type: bytes = b"application/connect+json") -> Handler:
    """An upstream that starts a chunked response, sends ``pieces`` as chunks, then goes away."""

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: " + content_type + b"\r\ntransfer-encoding: chunked\r\n\r\n")
        for piece in pieces:
            w.write(chunk(piece))
        await w.drain()

    return handler


START = envelope({"event": {"start": {"pid": 7}}})


@pytest.mark.parametrize(
    "pieces",
    [
        (START, envelope({"event": {"data": {"stdout": "aGk="}}})),  # between two envelopes
        (START[:3],),  # inside an envelope's prefix
        (START, envelope({"x": 1})[:8]),  # inside a payload
        (START, envelope({}, flags=0x02)),  # envd had ended the stream itself: nothing may follow
    ],
    ids=["between-envelopes", "mid-prefix", "mid-payload", "after-its-own-end"],
)
async def test_a_connect_stream_is_cut_wherever_it_broke(rig: Rig, pieces: tuple[bytes, ...]) -> None:
    proxy, _, _ = await rig(dies_after(*pieces))
    ex = Exchange(proxy, "POST", "/process.Process/Start", headers=CONNECT)
    ex.body(b"")
    await ex.done()
    assert not ex.complete and ex.content == b"".join(pieces)


async def test_other_responses_are_cut_too(rig: Rig) -> None:
    proxy, _, _ = await rig(dies_after(b'{"partial": ', content_type=b"application/json"))
    ex = Exchange(proxy, "POST", "/filesystem.Filesystem/ListDir", headers=[(b"content-type", b"application/json")])
    ex.body(b"")
    await ex.done()
    assert not ex.complete and ex.content == b'{"partial": '


def test_a_gateways_h2_client_is_seen_and_its_header_taken_off() -> None:
    """HTTP/2 at the node itself, or at the gateway that says so: a broken stream is then reset, not ended
    with ``unavailable``; the gateway's header does not reach the sandbox."""
    from aenv.api.proxy.connect_end import CLIENT_H2_HEADER, client_speaks_h2
    from aenv.gateway.proxy import GatewayProxy

    plain = {"type": "http", "http_version": "1.1", "headers": [(b"host", b"x")]}
    assert client_speaks_h2(plain) == (plain, False)
    assert client_speaks_h2({**plain, "http_version": "2"})[1] is True
    relayed, h2 = client_speaks_h2({**plain, "headers": [(b"host", b"x"), (CLIENT_H2_HEADER, b"1")]})
    assert h2 and relayed["headers"] == [(b"host", b"x")]
    told, h2 = GatewayProxy._client_h2(None, {**plain, "http_version": "2"})  # type: ignore[arg-type]
    assert h2 and (CLIENT_H2_HEADER, b"1") in told["headers"]
    assert GatewayProxy._client_h2(None, plain) == (plain, False)  # type: ignore[arg-type]

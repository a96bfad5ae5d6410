"""Envelope codec, call context parsing and the endpoint error edge."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from typing import Any

import pytest

from aenv.envd.connect import (
    FLAG_END_STREAM,
    CallContext,
    ClientStreamEndpoint,
    EnvelopeDecoder,
    ServerStreamEndpoint,
    UnaryEndpoint,
    decode_message,
    encode_envelope,
    end_stream_envelope,
    parse_keepalive,
    parse_timeout_ms,
)
from aenv.envd.errors import InvalidArgument, NotFound, ResourceExhausted, Unimplemented


def test_encode_envelope_is_flag_length_json() -> None:
    raw = encode_envelope({"a": 1})
    assert raw[0] == 0
    assert struct.unpack(">I", raw[1:5])[0] == len(raw) - 5
    assert json.loads(raw[5:]) == {"a": 1}


def test_end_stream_envelopes() -> None:
    ok = end_stream_envelope()
    assert ok[0] == FLAG_END_STREAM and json.loads(ok[5:]) == {}
    err = end_stream_envelope(NotFound("gone"))
    assert json.loads(err[5:]) == {"error": {"code": "not_found", "message": "gone"}}


def test_decoder_reassembles_split_envelopes() -> None:
    stream = encode_envelope({"start": {}}) + encode_envelope({"data": {"x": 1}}) + end_stream_envelope()
    decoder = EnvelopeDecoder()
    frames: list[tuple[int, bytes]] = []
    for i in range(len(stream)):
        frames += decoder.feed(stream[i : i + 1])
    decoder.finish()
    assert [json.loads(p) for _, p in frames] == [{"start": {}}, {"data": {"x": 1}}, {}]
    assert [f for f, _ in frames] == [0, 0, FLAG_END_STREAM]


def test_decoder_rejects_truncated_oversized_and_compressed() -> None:
    decoder = EnvelopeDecoder()
    decoder.feed(encode_envelope({"a": 1})[:-1])
    with pytest.raises(InvalidArgument, match="truncated"):
        decoder.finish()
    with pytest.raises(ResourceExhausted):
        EnvelopeDecoder(max_message_bytes=10).feed(struct.pack(">BI", 0, 11))
    with pytest.raises(Unimplemented):
        EnvelopeDecoder().feed(struct.pack(">BI", 1, 2) + b"{}")


@pytest.mark.parametrize("raw", [b"{", b"[1]", b'"s"', b"\xff"])
def test_decode_message_rejects_non_objects(raw: bytes) -> None:
    with pytest.raises(InvalidArgument):
        decode_message(raw)


def test_decode_message_empty_is_empty_object() -> None:
    assert decode_message(b"") == {}


def test_timeout_and_keepalive_headers() -> None:
    assert parse_timeout_ms(None) is None
    assert parse_timeout_ms("1500") == 1.5
    with pytest.raises(InvalidArgument):
        parse_timeout_ms("-1")
    assert parse_keepalive("50") == 50.0
    assert parse_keepalive("junk") == 90.0
    assert parse_keepalive(None) == 90.0


def test_username_from_basic_auth() -> None:
    ctx = CallContext(headers={"authorization": "Basic " + base64.b64encode(b"root:").decode()})
    assert ctx.username == "root"
    assert CallContext().username is None
    with pytest.raises(InvalidArgument):
        _ = CallContext(headers={"authorization": "Basic !!!"}).username


# --------------------------------------------------------------------------- endpoints over fake ASGI


class FakeASGI:
    """Drives an ASGI app with a scripted request body and records what it sends."""

    def __init__(
        self, chunks: list[bytes], headers: dict[str, str] | None = None, hang: bool = False
    ) -> None:
        self.chunks = list(chunks)
        self.hang = hang
        self.sent: list[dict[str, Any]] = []
        self.scope = {
            "type": "http",
            "method": "POST",
            "path": "/x",
            "headers": [(k.encode(), v.encode()) for k, v in (headers or {}).items()],
        }

    async def receive(self) -> dict[str, Any]:
        if self.chunks:
            chunk = self.chunks.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(self.chunks)}
        if self.hang:
            await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int:
        return int(self.sent[0]["status"])

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent[1:])

    def frames(self) -> list[tuple[int, Any]]:
        decoder = EnvelopeDecoder()
        out = [(f, json.loads(p)) for f, p in decoder.feed(self.body)]
        decoder.finish()
        return out


async def test_unary_success_and_error_mapping() -> None:
    async def handler(msg: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        if msg.get("fail"):
            raise NotFound("nope")
        if msg.get("crash"):
            raise RuntimeError("boom")
        return {"echo": msg}

    ok = FakeASGI([b'{"a":1}'])
    await UnaryEndpoint(handler)(ok.scope, ok.receive, ok.send)
    assert ok.status == 200 and json.loads(ok.body) == {"echo": {"a": 1}}

    nf = FakeASGI([b'{"fail":true}'])
    await UnaryEndpoint(handler)(nf.scope, nf.receive, nf.send)
    assert nf.status == 404 and json.loads(nf.body) == {"code": "not_found", "message": "nope"}

    crash = FakeASGI([b'{"crash":true}'])
    await UnaryEndpoint(handler)(crash.scope, crash.receive, crash.send)
    assert crash.status == 500 and json.loads(crash.body)["code"] == "internal"

    big = FakeASGI([b"x" * 100, b"y" * 100])
    await UnaryEndpoint(handler, max_body=150)(big.scope, big.receive, big.send)
    assert big.status == 429 and json.loads(big.body)["code"] == "resource_exhausted"


async def test_unary_deadline() -> None:
    async def slow(msg: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        await asyncio.Event().wait()
        return {}

    fake = FakeASGI([b"{}"], headers={"connect-timeout-ms": "10"})
    await UnaryEndpoint(slow)(fake.scope, fake.receive, fake.send)
    assert fake.status == 504 and json.loads(fake.body)["code"] == "deadline_exceeded"


async def test_server_stream_messages_then_end() -> None:
    async def handler(msg: dict[str, Any], ctx: CallContext) -> Any:
        yield {"n": 1}
        yield {"n": msg["k"]}

    fake = FakeASGI([encode_envelope({"k": 2})], hang=True)
    await ServerStreamEndpoint(handler, {"keepalive": {}})(fake.scope, fake.receive, fake.send)
    assert fake.status == 200
    assert dict(fake.sent[0]["headers"])[b"content-type"] == b"application/connect+json"
    assert fake.frames() == [(0, {"n": 1}), (0, {"n": 2}), (FLAG_END_STREAM, {})]


async def test_server_stream_error_before_first_message_is_end_stream() -> None:
    async def handler(msg: dict[str, Any], ctx: CallContext) -> Any:
        raise InvalidArgument("bad cwd")
        yield {}  # pragma: no cover

    fake = FakeASGI([encode_envelope({})], hang=True)
    await ServerStreamEndpoint(handler, {"keepalive": {}})(fake.scope, fake.receive, fake.send)
    assert fake.status == 200
    assert fake.frames() == [(FLAG_END_STREAM, {"error": {"code": "invalid_argument", "message": "bad cwd"}})]


async def test_server_stream_keepalive_and_deadline() -> None:
    async def handler(msg: dict[str, Any], ctx: CallContext) -> Any:
        yield {"first": True}
        await asyncio.Event().wait()

    fake = FakeASGI(
        [encode_envelope({})],
        headers={"keepalive-ping-interval": "0.01", "connect-timeout-ms": "100"},
        hang=True,
    )
    await ServerStreamEndpoint(handler, {"keepalive": {}})(fake.scope, fake.receive, fake.send)
    frames = fake.frames()
    assert frames[0] == (0, {"first": True})
    assert (0, {"keepalive": {}}) in frames
    assert frames[-1] == (
        FLAG_END_STREAM,
        {"error": {"code": "deadline_exceeded", "message": "context deadline exceeded"}},
    )


async def test_server_stream_disconnect_cancels_handler_without_end() -> None:
    cancelled = asyncio.Event()

    async def handler(msg: dict[str, Any], ctx: CallContext) -> Any:
        try:
            yield {"first": True}
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    fake = FakeASGI([encode_envelope({})])  # disconnects right after the body
    await ServerStreamEndpoint(handler, {"keepalive": {}})(fake.scope, fake.receive, fake.send)
    assert cancelled.is_set()
    assert all(flags != FLAG_END_STREAM for flags, _ in fake.frames())


async def test_client_stream_reads_envelopes_incrementally() -> None:
    seen: list[dict[str, Any]] = []

    async def handler(messages: Any, ctx: CallContext) -> dict[str, Any]:
        async for m in messages:
            seen.append(m)
        return {}

    body = encode_envelope({"start": {}}) + encode_envelope({"data": {"n": 1}})
    fake = FakeASGI([body[:7], body[7:], end_stream_envelope()])
    await ClientStreamEndpoint(handler)(fake.scope, fake.receive, fake.send)
    assert seen == [{"start": {}}, {"data": {"n": 1}}]
    assert fake.frames() == [(0, {}), (FLAG_END_STREAM, {})]

"""envd's loopback relays (``/init``'s ``aenvLoopbackRelay``, vm): validation, the set replaced by each
``/init``, and bytes piped both ways to the host side (here a server on this machine's own non-loopback
address stands in for slirp's gateway)."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest
from starlette.testclient import TestClient

from aenv.envd.app import HOST_FACTS_HEADER, build_app
from aenv.envd.relay import Relays, parse


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _own_address() -> str:
    """This machine's address on its default route (no packet is sent), or skip."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.254", 9))
        except OSError:
            pytest.skip("no IPv4 route off loopback")
        addr = str(s.getsockname()[0])
    if addr.startswith("127.") or addr == "0.0.0.0":
        pytest.skip("no IPv4 address off loopback")
    return addr


def test_parse() -> None:
    assert parse({"to": "10.0.2.2", "ports": [443, 80, 443]}) == ("10.0.2.2", (80, 443))
    assert parse({"to": "10.0.2.2", "ports": []}) == ("10.0.2.2", ())


@pytest.mark.parametrize("value", [
    [], {"to": "127.0.0.1", "ports": [80]}, {"to": "0.0.0.0", "ports": [80]}, {"to": "host", "ports": [80]},
    {"to": "10.0.2.2", "ports": [0]}, {"to": "10.0.2.2", "ports": [True]}, {"to": "10.0.2.2", "ports": "80"},
    {"to": "10.0.2.2", "ports": list(range(1, 40))}, {"to": "10.0.2.2"},
])  # fmt: skip
def test_parse_rejects(value: object) -> None:
    with pytest.raises(ValueError):
        parse(value)


def test_init_refuses_a_bad_relay_and_changes_nothing() -> None:
    client = TestClient(build_app())
    r = client.post("/init", json={"sandboxId": "s1", "aenvLoopbackRelay": {"to": "127.0.0.1", "ports": [80]}})
    assert r.status_code == 400 and "aenvLoopbackRelay" in r.json()["message"]


def test_init_reports_the_relays() -> None:
    port = _free_port()
    with TestClient(build_app()) as client:
        r = client.post("/init", json={"aenvLoopbackRelay": {"to": "10.0.2.2", "ports": [port]}})
        assert r.status_code == 204 and r.headers[HOST_FACTS_HEADER] == f"relay={port}"
        r = client.post("/init", json={"aenvLoopbackRelay": {"to": "10.0.2.2", "ports": []}})
        assert r.headers[HOST_FACTS_HEADER] == "relay=none"
    with socket.socket() as s:  # closed: the port is free again
        s.bind(("127.0.0.1", port))


async def test_relays_pipe_loopback_to_the_host_side_and_follow_each_set() -> None:
    to, port = _own_address(), _free_port()
    seen: list[bytes] = []

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = await reader.readuntil(b"\n")
        seen.append(data)
        writer.write(b"from " + to.encode() + b": " + data)
        await writer.drain()
        writer.close()

    try:
        server = await asyncio.start_server(upstream, to, port)
    except OSError:
        pytest.skip(f"{to}:{port} taken")
    relays = Relays()
    try:
        assert await relays.set(to, (port,)) == str(port)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /headers\n")
        await writer.drain()
        assert await reader.read() == b"from " + to.encode() + b": GET /headers\n"
        writer.close()
        await writer.wait_closed()
        assert seen == [b"GET /headers\n"]

        # a port something in the guest already listens on is reported, the others still relay
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            busy = taken.getsockname()[1]
            assert await relays.set(to, (port, busy)) == "failed"
            assert relays.ports == (port,)

        assert await relays.set(to, ()) == "none"
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)
    finally:
        await relays.aclose()
        server.close()
        with contextlib.suppress(Exception):
            await server.wait_closed()

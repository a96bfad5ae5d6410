"""Header rules for this server's own sandbox hosts (``runtime/egress_own.py``), without a sandbox: which
names count as this server's sandbox hosts (only those of the configured domain's pattern), the ports a
rule sends to the proxy on loopback and the host, the ``Host`` check every request passes, and the
interception to a TLS listener from a plain-HTTP client, refusing a request for another Host with 421."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.runtime import egress_rules
from aenv.runtime.egress_ca import EgressCa, new_ca, upstream_context
from aenv.runtime.egress_mitm import intercept
from aenv.runtime.egress_own import OwnHosts, refusal
from aenv.runtime.netpolicy import parse, render
from tests.unit.runtime.test_egress_rules import _echo, _test_pki

NAME = "8080-abc123.aenv.localhost"


def _own(**kw: object) -> OwnHosts | None:
    return OwnHosts.of(Settings(**kw))  # type: ignore[arg-type]


def test_only_a_configured_domain_and_its_sandbox_host_pattern() -> None:
    assert _own() is None  # no sandbox_domain: off
    own = _own(sandbox_domain="aenv.localhost:8443", port=9000, host="0.0.0.0")
    assert own == OwnHosts("aenv.localhost", 8443, "127.0.0.1", 9000, False)
    assert own.names(NAME) and own.names(NAME.upper() + ".")
    for other in ("api.aenv.localhost", "aenv.localhost", "8080-abc.evil.localhost", "x8080-abc.aenv.localhost",
                  "8080-abc.sub.aenv.localhost", "8080-abc.aenv.localhost.evil", "8080-.aenv.localhost",
                  "123456-abc.aenv.localhost"):
        assert not own.names(other), other
    assert _own(sandbox_domain="sbx.example.com", tls_cert=Path(__file__), tls_key=Path(__file__),
                host="10.1.2.3", port=8000) == OwnHosts("sbx.example.com", 443, "10.1.2.3", 8000, True)


def test_ports_come_from_rules_naming_own_hosts_only() -> None:
    own = OwnHosts("aenv.localhost", 8443, "127.0.0.1", 9000, True)

    def rules(*keys: str) -> tuple[egress_rules.HeaderRule, ...]:
        return egress_rules.parse({k: [{"transform": {"headers": {"X": "y"}}}] for k in keys})[0]

    assert own.ports(rules("api.example.com", "*.aenv.localhost", "api.aenv.localhost:8443")) == ()
    assert own.ports(rules(f"{NAME}:8443")) == (8443,)
    assert own.ports(rules(NAME)) == (80, 443, 8443)


def test_render_sends_loopback_and_host_on_own_ports_first() -> None:
    policy = parse(None, None, None, ["10.0.0.0/8"], rules={f"{NAME}:8443": [{"transform": {"headers": {"X": "y"}}}]},
                   bind=lambda n: n)
    lines = render(["192.168.1.5"], ["10.0.0.0/8"], "10.0.2.3", "10.0.2.3", policy, 4444, own_ports=(8443,)).splitlines()
    lo = lines.index("-A OUTPUT -p tcp -d 127.0.0.0/8 --dport 8443 -j REDIRECT --to-ports 4444")
    host = lines.index("-A OUTPUT -p tcp -d 192.168.1.5/32 --dport 8443 -j REDIRECT --to-ports 4444")
    assert lo < lines.index("-A OUTPUT -o lo -j RETURN") and host < lines.index("-A OUTPUT -p tcp -d 192.168.1.5/32 -j RETURN")
    without = render(["192.168.1.5"], ["10.0.0.0/8"], "10.0.2.3", "10.0.2.3", policy, 4444)
    assert "127.0.0.0/8 --dport" not in without and "192.168.1.5/32 --dport" not in without


def test_refusal_pins_the_host() -> None:
    ok = [(b"Host", NAME.encode()), (b"Accept", b"*/*")]
    assert refusal(b"GET", b"/headers", ok, NAME, 8443) is None
    assert refusal(b"GET", b"/", [(b"host", f"{NAME.upper()}:8443".encode())], NAME, 8443) is None
    bad = {
        "api": [(b"Host", b"api.aenv.localhost:8443")],
        "other sandbox": [(b"Host", b"49983-abc123.aenv.localhost")],
        "other port": [(b"Host", f"{NAME}:9000".encode())],
        "none": [],
        "two": [(b"Host", NAME.encode()), (b"Host", b"api.aenv.localhost")],
        "routing header": [*ok, (b"E2b-Sandbox-Id", b"other")],
        "routing port": [*ok, (b"e2b-sandbox-port", b"49983")],
    }
    for why, headers in bad.items():
        assert refusal(b"GET", b"/", headers, NAME, 8443), why
    assert refusal(b"GET", b"https://api.aenv.localhost/sandboxes", ok, NAME, 8443)
    assert refusal(b"CONNECT", b"api.aenv.localhost:8443", ok, NAME, 8443)


@pytest.mark.asyncio
async def test_pinned_interception_to_a_tls_listener(tmp_path: Path) -> None:
    ca_file, server_ctx, _ = _test_pki(tmp_path)  # the "server's listener" is echo.test's certificate
    rules, _ = egress_rules.parse({"echo.test": [{"transform": {"headers": {"X-Test-Token": "v"}}}]})
    up = await asyncio.start_server(_echo, "127.0.0.1", 0, ssl=server_ctx)
    up_port = up.sockets[0].getsockname()[1]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = await reader.read(16384)
        try:
            await intercept("sbx", reader, writer, first, host="echo.test", target="127.0.0.1", port=up_port,
                            rules=rules, tls=False, ca=EgressCa(*new_ca("sbx")),
                            upstream_ssl=upstream_context(str(ca_file)), lookup=lambda _id: None,
                            upstream_tls=True, pinned=8443)
        finally:
            writer.close()

    proxy = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with proxy, up:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.sockets[0].getsockname()[1])
        writer.write(b"GET /headers HTTP/1.1\r\nHost: echo.test:8443\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        body = await reader.readexactly(int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0]))
        assert json.loads(body)["headers"]["X-Test-Token"] == "v"
        writer.write(b"GET /sandboxes HTTP/1.1\r\nHost: api.aenv.localhost:8443\r\n\r\n")
        rest = await reader.read()
        writer.close()
    assert rest.startswith(b"HTTP/1.1 421 ") and b"Host must be echo.test" in rest


@pytest.mark.asyncio
async def test_handlers_are_held_and_cancelled_when_the_sandbox_goes() -> None:
    """A handler waiting on a kept-alive upstream (the server's own listener keeps a connection 5 s) after
    the sandbox's side closed is held by nothing asyncio keeps: it is held here, and cancelled with its
    listener, never left for the garbage collector to destroy pending."""
    import gc
    import socket

    from aenv.runtime import egress

    enforcer = egress.Enforcer()
    waiting = asyncio.Event()
    ended: list[str] = []

    async def serve(key: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        waiting.set()
        try:
            await asyncio.get_running_loop().create_future()  # an upstream that never answers
        finally:
            ended.append(key)

    enforcer._serve = serve  # type: ignore[method-assign]
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    sock.setblocking(False)
    await enforcer._serve_on("sbx", 1, sock)
    _, writer = await asyncio.open_connection(*sock.getsockname())
    await waiting.wait()
    writer.close()  # the sandbox's side is done
    await asyncio.sleep(0.05)
    gc.collect()
    assert len(egress._HANDLERS) == 1 and not ended
    enforcer.forget("sbx")
    await asyncio.sleep(0.05)
    assert ended == ["sbx"] and not egress._HANDLERS


def test_a_vm_guest_relays_its_loopback_on_the_own_ports_only() -> None:
    """What each vm ``/init`` carries (``vm/sandbox.loopback_relay``, run by ``envd/relay.py``): the ports of
    the rules naming this server's sandbox hosts, to slirp's gateway; none without such a rule, a policy or
    a ``sandbox_domain`` (the empty set is sent too, so a restored guest drops its snapshot's relays)."""
    from aenv.runtime import network
    from aenv.runtime.egress import ENFORCER
    from aenv.runtime.vm.sandbox import loopback_relay

    rule = [{"transform": {"headers": {"X": "y"}}}]
    sid = "relay-test-sbx"
    try:
        network.configure_own(OwnHosts("aenv.localhost", 8443, "127.0.0.1", 9000, True))
        ENFORCER.register(sid, parse(None, None, None, [], rules={f"{NAME}:8443": rule, "api.example.com": rule},
                                     bind=lambda n: n))
        assert loopback_relay(sid) == {"aenvLoopbackRelay": {"to": "10.0.2.2", "ports": [8443]}}
        ENFORCER.register(sid, parse(None, None, None, [], rules={"api.example.com": rule}, bind=lambda n: n))
        assert loopback_relay(sid)["aenvLoopbackRelay"]["ports"] == []
        ENFORCER.register(sid, parse(None, None, None, [], rules={f"{NAME}:8443": rule}, bind=lambda n: n))
        network.configure_own(None)
        assert loopback_relay(sid)["aenvLoopbackRelay"]["ports"] == []
        assert loopback_relay("no-policy")["aenvLoopbackRelay"]["ports"] == []
    finally:
        network.configure_own(None)
        ENFORCER.register(sid, None)

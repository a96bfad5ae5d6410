"""E2B's network.rules in the egress proxy, without a sandbox: validation (every unsupported field a
400 naming it), secret placeholders bound to IDs, matching, header rewriting, the per-sandbox CA and
its leaves, the iptables it adds, and the interception itself against a local HTTPS echo server (TLS
terminated with the sandbox's CA, upstream verified, headers set on every request of a kept-alive
connection, bodies streamed, a bad upstream certificate refused, a deleted secret answered 502)."""

from __future__ import annotations

import asyncio
import json
import ssl
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from aenv.errors import InvalidRequest
from aenv.runtime import egress_rules
from aenv.runtime.egress_ca import EgressCa, new_ca, upstream_context
from aenv.runtime.egress_mitm import intercept
from aenv.runtime.egress_rules import SecretRef, UnresolvedSecret
from aenv.runtime.netpolicy import from_record, parse, render

SECRET = "tok-" + "9" * 20


def _rules(headers: dict[str, Any], domain: str = "api.example.com") -> dict[str, Any]:
    return {domain: [{"transform": {"headers": headers}}]}


def test_parse_binds_placeholders_and_refuses_what_it_cannot_do() -> None:
    seen: list[str] = []

    def bind(name: str) -> str:
        seen.append(name)
        return "sec_" + name

    rules, ids = egress_rules.parse(_rules({"Authorization": "Bearer ${e2b.secrets.OpenAI}", "X-A": "plain"}) |
                                    {"*.wild.example:8443": [{"transform": {"headers": {"X-B": "${e2b.secrets.openai}"}}}]},
                                    bind=bind)
    assert ids == {"openai": "sec_openai"} and seen == ["openai"]  # bound once
    assert rules[0].headers[0] == ("Authorization", ("Bearer ", SecretRef("openai", "sec_openai")))
    assert rules[1].pattern == "*.wild.example" and rules[1].port == 8443
    assert egress_rules.ports(rules) == (80, 443, 8443)
    for bad, word in (
        (_rules({"X": "${e2b.identity.tokens.aws}"}), "identity"),
        (_rules({"Host": "x"}), "Host"),
        (_rules({"Bad Name": "x"}), "header name"),
        (_rules({"X": "a\r\nY: b"}), "CR"),
        (_rules({"X": 5}), "string"),
        ({"10.0.0.1": [{"transform": {"headers": {"X": "y"}}}]}, "not a domain"),
        ({"api.example.com:0": []}, "port"),
        ({"api.example.com": [{"transform": {"headers": {}}, "match": {}}]}, "match"),
        ({"api.example.com": [{"transform": {"body": "x"}}]}, "transform.body"),
        ({"api.example.com": {"x": 1}}, "list"),
        ([1], "object"),
    ):
        with pytest.raises(InvalidRequest, match=word):
            egress_rules.parse(bad, bind=bind)


def test_policy_record_round_trip_and_masking() -> None:
    given = _rules({"Authorization": "Bearer ${e2b.secrets.k}", "X-Literal": "s3cr3t"})
    policy = parse(None, None, None, [], rules=given, bind=lambda n: "sec_1")
    assert policy.needs_proxy and not policy.empty and not policy.proxies_denied
    assert policy.record["rules"] == given and policy.record["secretIDs"] == {"k": "sec_1"}
    again = from_record(policy.record, [])
    assert again.rules == policy.rules  # a restart binds from the record, no lookups
    gone = from_record({"rules": given}, [])  # no IDs kept: an unbound reference, answered 502 later
    assert gone.rules[0].headers[0][1][1] == SecretRef("k", None)
    assert egress_rules.masked(given) == _rules({"Authorization": "***", "X-Literal": "***"})


def test_resolve_rewrite_and_matching() -> None:
    rules, _ = egress_rules.parse(_rules({"Authorization": "Bearer ${e2b.secrets.k}"}) |
                                  {"*.example.com": [{"transform": {"headers": {"X-W": "w"}}}]}, bind=lambda n: "sec_k")
    hit = egress_rules.matching(rules, "API.example.com.", 443)
    assert len(hit) == 2 and egress_rules.matching(rules, "example.com", 443) == []
    add = egress_rules.resolve(hit, {"sec_k": SECRET}.get)
    assert add == [(b"Authorization", b"Bearer " + SECRET.encode()), (b"X-W", b"w")]
    out = egress_rules.rewrite([(b"authorization", b"old"), (b"Accept", b"*/*")], add)
    assert out == [(b"Accept", b"*/*"), *add]
    with pytest.raises(UnresolvedSecret, match="^k$"):
        egress_rules.resolve(hit, lambda _id: None)


def test_render_redirects_rule_ports_before_allowed_addresses() -> None:
    policy = parse(["8.8.8.8"], ["0.0.0.0/0"], None, ["10.0.0.0/8"], rules=_rules({"X": "y"}), bind=lambda n: n)
    text = render(["192.168.1.5"], ["10.0.0.0/8"], "10.0.2.3", "10.0.2.3", policy, proxy_port=4444)
    lines = text.splitlines()
    redirect_443 = lines.index("-A OUTPUT -p tcp --dport 443 -j REDIRECT --to-ports 4444")
    assert lines.index("-A OUTPUT -p tcp -d 192.168.1.5/32 -j RETURN") < redirect_443
    assert lines.index("-A OUTPUT -p tcp -d 10.0.0.0/8 -j RETURN") < redirect_443
    assert "-A OUTPUT -p tcp --dport 80 -j REDIRECT --to-ports 4444" in lines
    assert "-A OUTPUT -p tcp -d 0.0.0.0/0 -j REDIRECT --to-ports 4444" not in lines  # no domain in allowOut
    rules_only = render([], [], "10.0.2.3", "10.0.2.3", parse(None, None, None, [], rules=_rules({"X": "y"}),
                                                                    bind=lambda n: n), proxy_port=4444)
    assert "--dport 443 -j REDIRECT" in rules_only and "-j REJECT" not in rules_only.split("*filter")[1].replace(
        "-d 127.0.0.1/32 -m conntrack --ctstate DNAT -j ACCEPT", "")


def test_ca_and_leaves_verify_strictly() -> None:
    cert_pem, key_pem = new_ca("sbx1")
    ca = EgressCa(cert_pem, key_pem)
    leaf = x509.load_pem_x509_certificates(ca.leaf_pem("api.example.com"))[0]
    assert leaf.issuer == x509.load_pem_x509_certificate(cert_pem).subject
    assert ca.server_context("api.example.com") is ca.server_context("api.example.com")  # made once
    assert b"PRIVATE KEY" not in cert_pem


# ---- the interception, end to end on loopback --------------------------------------------------
def _test_pki(tmp: Path) -> tuple[Path, ssl.SSLContext, ssl.SSLContext]:
    """A 'public' CA, the echo server's context (for echo.test) and a context that does not verify."""
    ca_pem, ca_key = new_ca("public")
    public = EgressCa(ca_pem, ca_key)
    ca_file = tmp / "public-ca.pem"
    ca_file.write_bytes(ca_pem)
    server = public.server_context("echo.test")
    stranger = EgressCa(*new_ca("stranger")).server_context("echo.test")
    return ca_file, server, stranger


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """HTTP/1.1 keep-alive echo: answers each request with its headers and body length as JSON."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")[1:-2]
            headers = dict(line.split(": ", 1) for line in lines)
            body = b""
            if "Transfer-Encoding" in headers or "transfer-encoding" in headers:
                while (size := int((await reader.readline()).strip(), 16)) > 0:
                    body += (await reader.readexactly(size + 2))[:-2]
                await reader.readline()
            else:
                body = await reader.readexactly(int(headers.get("content-length", headers.get("Content-Length", "0"))))
            out = json.dumps({"headers": headers, "body": len(body)}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(out), out))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def _proxy(upstream: ssl.SSLContext | None, tls: bool, lookup: dict[str, str]) -> tuple[Any, Any, EgressCa]:
    rules, _ = egress_rules.parse(_rules({"X-Token": "${e2b.secrets.k}", "X-Fixed": "f"}, "echo.test"),
                                  bind=lambda n: "sec_k")
    sandbox_ca = EgressCa(*new_ca("sbx"))
    up_server = await asyncio.start_server(_echo, "127.0.0.1", 0, ssl=upstream)
    up_port = up_server.sockets[0].getsockname()[1]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = await reader.read(16384)
        try:
            await intercept("sbx", reader, writer, first, host="echo.test", target="127.0.0.1", port=up_port,
                            rules=rules, tls=tls, ca=sandbox_ca, upstream_ssl=_UPSTREAM.get("ctx"),
                            lookup=lookup.get)
        finally:
            writer.close()

    proxy = await asyncio.start_server(handle, "127.0.0.1", 0)
    return proxy, up_server, sandbox_ca


_UPSTREAM: dict[str, ssl.SSLContext] = {}


async def _exchange(port: int, ca: EgressCa | None, requests: list[bytes]) -> bytes:
    ctx = None
    if ca is not None:
        ctx = ssl.create_default_context(cadata=ca.cert_pem.decode())
        ctx.set_alpn_protocols(["h2", "http/1.1"])
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx,
                                                   server_hostname="echo.test" if ctx else None)
    if ctx is not None:
        assert writer.get_extra_info("ssl_object").selected_alpn_protocol() == "http/1.1"
    out = b""
    for req in requests:
        writer.write(req)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        out += head + await reader.readexactly(length) + b"\n"
    writer.close()
    return out


REQ = b"GET /headers HTTP/1.1\r\nHost: echo.test\r\nX-Token: forged\r\n\r\n"
POST = (b"POST /up HTTP/1.1\r\nHost: echo.test\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")


@pytest.mark.asyncio
async def test_https_interception_sets_headers_on_every_request(tmp_path: Path) -> None:
    ca_file, server_ctx, _ = _test_pki(tmp_path)
    _UPSTREAM["ctx"] = upstream_context(str(ca_file))
    proxy, up, sandbox_ca = await _proxy(server_ctx, True, {"sec_k": SECRET})
    async with proxy, up:
        got = await _exchange(proxy.sockets[0].getsockname()[1], sandbox_ca, [REQ, POST, REQ])
    answers = [json.loads(line[line.index(b"{"):]) for line in got.split(b"\n") if b"{" in line]
    assert len(answers) == 3
    for a in answers:
        assert a["headers"]["X-Token"] == SECRET and a["headers"]["X-Fixed"] == "f"
    assert answers[1]["body"] == 11


@pytest.mark.asyncio
async def test_plain_http_interception(tmp_path: Path) -> None:
    proxy, up, _ = await _proxy(None, False, {"sec_k": SECRET})
    async with proxy, up:
        got = await _exchange(proxy.sockets[0].getsockname()[1], None, [REQ])
    assert json.loads(got[got.index(b"{"):])["headers"]["X-Token"] == SECRET


@pytest.mark.asyncio
async def test_unverified_upstream_and_deleted_secret(tmp_path: Path) -> None:
    ca_file, _, stranger = _test_pki(tmp_path)
    _UPSTREAM["ctx"] = upstream_context(str(ca_file))
    proxy, up, sandbox_ca = await _proxy(stranger, True, {"sec_k": SECRET})
    async with proxy, up:
        with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)):
            await _exchange(proxy.sockets[0].getsockname()[1], sandbox_ca, [REQ])
    proxy, up, _ = await _proxy(None, False, {})  # the secret is gone
    async with proxy, up:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.sockets[0].getsockname()[1])
        writer.write(REQ)
        answer = await reader.read()
        writer.close()
    assert answer.startswith(b"HTTP/1.1 502") and b"secret 'k'" in answer and SECRET.encode() not in answer


class _StoreDown(dict[str, str]):
    """A secrets store that does not answer (cluster mode: its Redis is down)."""

    def get(self, *_: Any) -> Any:  # type: ignore[override]
        from aenv.errors import StoreUnavailable

        raise StoreUnavailable("secrets: the cluster's Redis is unreachable")


@pytest.mark.asyncio
async def test_a_store_that_does_not_answer_refuses_the_request() -> None:
    proxy, up, _ = await _proxy(None, False, _StoreDown())
    async with proxy, up:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.sockets[0].getsockname()[1])
        writer.write(REQ)
        answer = await reader.read()
        writer.close()
    assert answer.startswith(b"HTTP/1.1 503") and b"cannot be read now" in answer

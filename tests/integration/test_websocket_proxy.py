"""WebSocket and long-lived streams through the sandbox proxy, end to end: a WebSocket echo server
started in a sandbox through the SDK (``sbx.commands.run(..., background=True)``; the ``websockets``
package shipped to it in one zip, see bench/ws.py), a real client on the host (the ``websockets``
package), both routing modes (``E2b-Sandbox-*`` headers, and the Host name ``sbx.get_host(port)`` names).

Text and binary messages, a large one and one over the limit, pings both ways, fragments, closes and
half closes from each side, refusals; after each close nothing is left open: the echo server counts no
connection, and the sandbox's kernel shows no socket of the proxy's connection still established or half
closed (what a stream the proxy forgot would leave). SSE streams arrive event by event, with pauses.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, ConnectionClosedError, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from aenv.testing.server import Server
from bench.ws import PORT, start_in_sandbox

pytestmark = pytest.mark.timeout(600)

SSE = r"""
import http.server, sys, time
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        chunked = self.path == "/chunked"
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding" if chunked else "connection", "chunked" if chunked else "close")
        self.end_headers()
        for i in range(3):
            time.sleep(1.5)
            ev = b"data: %d\n\n" % i
            self.wfile.write(b"%x\r\n%s\r\n" % (len(ev), ev) if chunked else ev)
            self.wfile.flush()
        if chunked:
            self.wfile.write(b"0\r\n\r\n")
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), H).serve_forever()
"""
SSE_PORT = 8766


@pytest.fixture(scope="module")
def echo(e2b_env: dict[str, str], server: Server) -> Iterator[Any]:
    """A sandbox with the echo server listening on PORT (and the SSE server on SSE_PORT)."""
    from e2b import Sandbox

    sbx = Sandbox.create("base", timeout=900)
    try:
        start_in_sandbox(sbx, PORT, timeout=180)
        sbx.files.write("/tmp/sse.py", SSE)
        sbx.commands.run(f"python3 /tmp/sse.py {SSE_PORT}", background=True, timeout=0)
        yield sbx
    finally:
        sbx.kill()


def _open(server: Server, sbx: Any, mode: str, port: int = PORT, path: str = "/", **kwargs: Any) -> ClientConnection:
    host_port = int(server.url.rsplit(":", 1)[1])
    if mode == "headers":
        headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(port)}
        return connect(f"ws://127.0.0.1:{host_port}{path}", additional_headers=headers, proxy=None,
                       open_timeout=60, **kwargs)  # fmt: skip
    # The name the SDK gives the port; *.localhost is the test's to resolve (to this machine).
    host = sbx.get_host(port)
    assert host == f"{port}-{sbx.sandbox_id}.localhost:{host_port}"
    sock = socket.create_connection(("127.0.0.1", host_port), timeout=60)
    return connect(f"ws://{host}{path}", sock=sock, proxy=None, open_timeout=60, **kwargs)


def _stats(server: Server, sbx: Any) -> dict[str, Any]:
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(PORT)}
    res = httpx.get(f"{server.url}/stats", headers=headers, trust_env=False, timeout=60)
    assert res.status_code == 200, res.text
    stats: dict[str, Any] = res.json()
    return stats


def _open_sockets(sbx: Any) -> list[str]:
    """The sandbox's TCP sockets of connections to PORT still established, half closed or closing (what
    the agent's end of a stream the proxy kept open would be in)."""
    out = sbx.commands.run("cat /proc/net/tcp /proc/net/tcp6 2>/dev/null; true", timeout=60).stdout  # vm: no IPv6
    live = {"01", "05", "07", "08", "09"}  # established, fin-wait-2, close, close-wait, last-ack
    found = []
    for line in out.splitlines()[1:]:
        parts = line.split()
        if len(parts) > 3 and parts[3] in live:
            ports = {int(parts[1].rsplit(":", 1)[1], 16), int(parts[2].rsplit(":", 1)[1], 16)}
            if PORT in ports:
                found.append(line.strip())
    return found


def _settled(server: Server, sbx: Any, closes_before: int) -> dict[str, Any]:
    """Until the echo server saw the connection end and no socket of it is left in the sandbox."""
    deadline = time.monotonic() + 60
    while True:
        stats = _stats(server, sbx)
        sockets = _open_sockets(sbx)
        if stats["open"] == 0 and len(stats["closes"]) > closes_before and not sockets:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"still open after the close: stats={stats} sockets={sockets}")
        time.sleep(0.2)


@pytest.mark.parametrize("mode", ["headers", "host"])
def test_messages_pings_and_a_client_close(server: Server, echo: Any, mode: str) -> None:
    before = len(_stats(server, echo)["closes"])
    with _open(server, echo, mode, max_size=None) as ws:
        ws.send("hello")
        assert ws.recv(timeout=60) == "hello"
        ws.send(b"\x00\x01\xfe\xff")
        assert ws.recv(timeout=60) == b"\x00\x01\xfe\xff"
        big = bytes(range(256)) * 32768  # 8 MiB
        ws.send(big)
        assert ws.recv(timeout=120) == big
        assert ws.ping(b"from-client").wait(60)  # the client's ping is answered
        ws.send("ping-me")  # the server's ping is answered, then it says so
        assert ws.recv(timeout=60) == "ponged"
        ws.send("fragments")
        assert ws.recv(timeout=60) == "abcdef"
        ws.close(4000, "episode over")
    stats = _settled(server, echo, before)
    assert stats["closes"][-1] == [4000, "episode over"]


@pytest.mark.parametrize("mode", ["headers", "host"])
def test_the_sandbox_closes(server: Server, echo: Any, mode: str) -> None:
    before = len(_stats(server, echo)["closes"])
    with _open(server, echo, mode) as ws:
        ws.send("close-me")
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=60)
    assert closed.value.rcvd is not None and (closed.value.rcvd.code, closed.value.rcvd.reason) == (4001, "bye")
    _settled(server, echo, before)


@pytest.mark.parametrize("how", ["drop", "half-close"])
def test_the_sandbox_side_ends_without_a_close(server: Server, echo: Any, how: str) -> None:
    before = len(_stats(server, echo)["closes"])
    with _open(server, echo, "headers") as ws:
        ws.send(how)
        with pytest.raises(ConnectionClosedError) as closed:
            ws.recv(timeout=60)
    assert closed.value.rcvd is None  # no close frame: the client's connection was dropped, as the server's was
    _settled(server, echo, before)


def test_a_client_half_close_ends_the_sandbox_side(server: Server, echo: Any) -> None:
    before = len(_stats(server, echo)["closes"])
    with _open(server, echo, "host") as ws:
        ws.send("still here")
        assert ws.recv(timeout=60) == "still here"
        ws.socket.shutdown(socket.SHUT_WR)
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=60)
    _settled(server, echo, before)


def test_a_message_over_the_limit_is_refused(server: Server, echo: Any) -> None:
    before = len(_stats(server, echo)["closes"])
    with _open(server, echo, "headers", max_size=None) as ws:
        ws.send(b"x" * (17 << 20))  # the server's ws_max_message is 16 MiB
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=120)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
    assert _settled(server, echo, before)["closes"][-1][0] == 1009  # the sandbox heard why


def test_refusals_and_the_server_still_serving(server: Server, echo: Any) -> None:
    for port, path, status, words in [(9, "/", 502, "port is not open"), (49983, "/init", 403, "internal envd route")]:
        with pytest.raises(InvalidStatus) as refused:
            _open(server, echo, "headers", port=port, path=path)
        assert refused.value.response.status_code == status
        assert words in json.loads(refused.value.response.body)["message"]
    upgrade = httpx.get(f"{server.url}/", trust_env=False, timeout=60, headers={
        "E2b-Sandbox-Id": echo.sandbox_id, "E2b-Sandbox-Port": str(PORT), "Connection": "Upgrade", "Upgrade": "tcp"})
    assert upgrade.status_code == 501 and upgrade.json()["code"] == 501
    accepted = _stats(server, echo)["accepted"]
    for mode in ("headers", "host"):
        with _open(server, echo, mode) as ws:
            ws.send("after all that")
            assert ws.recv(timeout=60) == "after all that"
    assert _stats(server, echo)["accepted"] == accepted + 2


@pytest.mark.parametrize("path", ["/sse", "/chunked"])
def test_event_streams_arrive_event_by_event(server: Server, echo: Any, path: str) -> None:
    headers = {"E2b-Sandbox-Id": echo.sandbox_id, "E2b-Sandbox-Port": str(SSE_PORT)}
    deadline = time.monotonic() + 120
    while True:  # the SSE server may still be starting
        try:
            with httpx.stream("GET", f"{server.url}{path}", headers=headers, trust_env=False, timeout=60) as res:
                if res.status_code == 502 and time.monotonic() < deadline:
                    res.read()
                    time.sleep(0.5)
                    continue
                assert res.status_code == 200 and res.headers["content-type"] == "text/event-stream"
                arrivals = []
                for line in res.iter_lines():
                    if line.startswith("data: "):
                        arrivals.append((time.monotonic(), line))
                break
        except httpx.RemoteProtocolError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    assert [line for _, line in arrivals] == ["data: 0", "data: 1", "data: 2"]
    gaps = [b[0] - a[0] for a, b in zip(arrivals, arrivals[1:], strict=False)]
    assert all(gap > 0.9 for gap in gaps), gaps  # each event as it was sent, not held back to the end

"""``aenv serve`` with TLS runs hypercorn (cli/tls_serve.py): HTTP/2 by ALPN with an HTTP/1.1 fallback,
and a response its app leaves unfinished (a proxied body cut mid-way) ends as a stream reset over h2
(hypercorn alone leaves that stream open: the client hangs) and as a cut connection over HTTP/1.1. Both
are what E2B's SDKs take for a transport failure. A toy app on 127.0.0.1 and a throwaway certificate."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from aenv.cli.tls_serve import serve_tls
from aenv.config import Settings
from aenv.testing.server import free_port

pytestmark = [
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl for the certificate"),
    pytest.mark.asyncio(loop_scope="session"),  # the loop the server fixture runs on
]


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    if scope["path"] == "/cut":  # a first piece, then the app returns without ending the body
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        return
    await send({"type": "http.response.body", "body": scope["http_version"].encode()})


@pytest.fixture
def cert(tmp_path: Path) -> Path:
    """A self-signed certificate for 127.0.0.1 (cert.pem, key.pem in tmp_path)."""
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", "key.pem", "-out", "cert.pem", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"],
                   cwd=tmp_path, check=True, capture_output=True, timeout=60)  # fmt: skip
    return tmp_path


@pytest.fixture
async def server(cert: Path, tmp_path: Path) -> AsyncIterator[tuple[str, ssl.SSLContext]]:
    port = free_port()
    settings = Settings(host="127.0.0.1", port=port, state_dir=tmp_path / "state", log_level="warning",
                        tls_cert=tmp_path / "cert.pem", tls_key=tmp_path / "key.pem")  # fmt: skip
    stop = asyncio.Event()
    task = asyncio.create_task(serve_tls(_app, settings, stop.wait))
    ctx = ssl.create_default_context(cafile=str(tmp_path / "cert.pem"))
    url = f"https://127.0.0.1:{port}"
    for _ in range(200):
        try:
            async with httpx.AsyncClient(verify=ctx, trust_env=False, timeout=5) as http:
                await http.get(url + "/")
            break
        except httpx.ConnectError:
            await asyncio.sleep(0.05)
    try:
        yield url, ctx
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_h2_is_negotiated_and_a_cut_stream_is_reset_not_left_open(server: tuple[str, ssl.SSLContext]) -> None:
    url, ctx = server
    async with httpx.AsyncClient(http2=True, http1=False, verify=ctx, trust_env=False, timeout=10) as http:
        ok = await http.get(url + "/")
        assert (ok.http_version, ok.text) == ("HTTP/2", "2")
        with pytest.raises(httpx.RemoteProtocolError, match="StreamReset"):
            await http.get(url + "/cut")
        again = await http.get(url + "/")  # the connection outlives the reset stream
        assert (again.http_version, again.text) == ("HTTP/2", "2")


async def test_http11_is_the_fallback_and_a_cut_body_cuts_the_connection(server: tuple[str, ssl.SSLContext]) -> None:
    url, ctx = server
    async with httpx.AsyncClient(verify=ctx, trust_env=False, timeout=10) as http:  # ALPN http/1.1 only
        ok = await http.get(url + "/")
        assert (ok.http_version, ok.text) == ("HTTP/1.1", "1.1")
        with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
            await http.get(url + "/cut")

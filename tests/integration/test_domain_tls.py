"""The sandbox domain and HTTPS, end to end: ``aenv serve --tls-cert/--tls-key`` with a CA and a
certificate this test makes (``openssl``), and the unmodified E2B SDK configured only as E2B's own users
configure it, ``E2B_DOMAIN`` (+ the CA in ``SSL_CERT_FILE``) and no ``E2B_API_URL``/``E2B_SANDBOX_URL``.

The SDK then calls ``https://api.<domain>``, aenv answers with that domain, and the SDK reaches envd as
``https://49983-<id>.<domain>`` (Host routing) and the sandbox's own ports as ``get_host(port)``: here
``wss://<port>-<id>.<domain>/``. The names are under ``localhost``, which the SDK's resolver (hickory)
sends to this machine without DNS; the test's other clients are pointed at 127.0.0.1 by hand. The domain
has a label before ``localhost`` because a certificate's wildcard may not stand right before a
top-level name (``*.localhost`` matches nothing).

With TLS the server speaks HTTP/2 (ALPN ``h2``, hypercorn) and the SDK's transport takes it; a command
whose sandbox is killed mid-stream then ends in a stream reset, which the SDK answers with a ``/health``
probe and ``SandboxNotRunningException``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from aenv.testing.server import API_KEY, Server, Tls, discard_vm_state, free_port, start_server, stop_server

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(900), pytest.mark.sdk]

SDK_SCRIPT = r"""
import json, os, socket, ssl, sys, threading
from e2b import Sandbox, SandboxNotRunningException
from websockets.sync.client import connect
from bench.ws import PORT, start_in_sandbox

out = {}
sbx = Sandbox.create("base", timeout=600)
try:
    out["domain"] = sbx.sandbox_domain
    out["envd_url"] = sbx.envd_api_url
    out["echo"] = sbx.commands.run("echo over https").stdout.strip()
    sbx.files.write("/tmp/f.txt", "file over https")
    out["file"] = sbx.files.read("/tmp/f.txt")
    out["connected"] = Sandbox.connect(sbx.sandbox_id).commands.run("echo again").stdout.strip()
    # Over h2 a stream whose sandbox goes away is reset (cli/tls_serve.py): the SDK probes /health
    doomed = Sandbox.create("base", timeout=600)
    handle = doomed.commands.run("sleep 600", background=True, timeout=0)
    killer = threading.Timer(1.0, Sandbox.kill, args=(doomed.sandbox_id,))
    killer.start()
    try:
        handle.wait()
    except SandboxNotRunningException as exc:
        out["killed"] = str(exc)
    finally:
        killer.join()
    start_in_sandbox(sbx, PORT, timeout=180)
    host = sbx.get_host(PORT)
    out["host"] = host
    ctx = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
    sock = socket.create_connection(("127.0.0.1", int(host.rsplit(":", 1)[1])), timeout=60)
    with connect(f"wss://{host}/", sock=sock, ssl=ctx, proxy=None, open_timeout=60) as ws:
        ws.send("over wss")
        out["ws"] = ws.recv(timeout=60)
finally:
    sbx.kill()
print(json.dumps(out))
"""


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_tls(tmp: Path, names: list[str]) -> Tls:
    """A throwaway CA and a server certificate it signed for ``names`` (DNS names; 127.0.0.1 too)."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=aenv test CA",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=tmp)  # fmt: skip
    _openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", f"/CN={names[0]}", cwd=tmp)
    sans = ",".join([*(f"DNS:{n}" for n in names), "IP:127.0.0.1"])
    (tmp / "ext.cnf").write_text(f"subjectAltName={sans}\nbasicConstraints=CA:FALSE\n"
                                 "keyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n")  # fmt: skip
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.pem", "-days", "2", "-extfile", "ext.cnf", cwd=tmp)  # fmt: skip
    return Tls(cert=tmp / "server.pem", key=tmp / "server.key", ca=tmp / "ca.pem")


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory,
               runtime_name: str) -> Iterator[tuple[Server, str, tuple[Server, ...]]]:
    if os.geteuid() != 0:
        pytest.skip("the ns and vm runtimes need root")
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make the test's CA")
    if runtime_name == "vm":
        from aenv.config import Settings
        from aenv.runtime.vm.runtime import unavailable_reason

        if (why := unavailable_reason(Settings())) is not None:
            pytest.skip(f"vm runtime unavailable: {why}")
    tmp = tmp_path_factory.mktemp("aenv-tls")
    tls = make_tls(tmp, ["aenv.localhost", "*.aenv.localhost", "localhost"])
    port = free_port()
    srv = start_server(tmp, runtime_name, port=port, tls=tls)
    try:
        yield srv, f"aenv.localhost:{port}", ()
    finally:
        stop_server(srv)
        discard_vm_state(srv.state_dir)


@pytest.fixture(scope="module")
def tls_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str, tuple[Server, ...]]]:
    """``aenv gateway --tls-cert --tls-key`` in front of one plain-HTTP node: the same E2B_DOMAIN client
    (the node's log is shown beside the gateway's when the client fails)."""
    from aenv.testing.gateway import start_gateway, stop_gateway

    if os.geteuid() != 0 or shutil.which("openssl") is None:
        pytest.skip("needs root (the ns runtime) and the openssl command (the test's CA)")
    tmp = tmp_path_factory.mktemp("aenv-tls-gateway")
    tls = make_tls(tmp, ["aenv.localhost", "*.aenv.localhost", "localhost"])
    node = start_server(tmp_path_factory.mktemp("aenv-tls-node"), "ns")
    try:
        port = free_port()
        gw = start_gateway(tmp, [node.url], port=port, tls=tls)
        try:
            yield gw, f"aenv.localhost:{port}", (node,)
        finally:
            stop_gateway(gw)
    finally:
        stop_server(node)


@pytest.mark.parametrize("endpoint", ["tls_server", "tls_gateway"])
def test_the_sdk_with_only_e2b_domain_over_https(endpoint: str, request: pytest.FixtureRequest) -> None:
    srv, domain, behind = request.getfixturevalue(endpoint)
    assert srv.ca is not None
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"),
        "PYTHONPATH": f"{REPO}:{REPO / 'src'}", "E2B_DOMAIN": domain, "E2B_API_KEY": API_KEY,
        "SSL_CERT_FILE": str(srv.ca),
    }  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", SDK_SCRIPT], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    logs = "".join(f"\n--- node log ({b.url}) ---\n{b.log_tail(120)}" for b in behind)
    assert proc.returncode == 0, f"{proc.stderr[-4000:]}\n--- server log ---\n{srv.log_tail()}{logs}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    sid_host = out["host"].split(".", 1)[0]
    assert out["domain"] == domain
    assert out["envd_url"] == f"https://49983-{sid_host.split('-', 1)[1]}.{domain}"
    assert out["host"] == f"{sid_host}.{domain}" and sid_host.startswith("8765-")
    assert "killed or reached its end of life" in out.get("killed", ""), out
    assert "ended before the stream completed" not in out["killed"], out  # a reset (h2), not `unavailable`
    assert (out["echo"], out["file"], out["connected"], out["ws"]) == (
        "over https", "file over https", "again", "over wss")


def test_https_speaks_h2_and_http11_and_refuses_plain_http_and_a_wrong_name(tls_server: tuple[Server, str, tuple[Server, ...]]) -> None:
    srv, domain, _ = tls_server
    assert srv.ca is not None
    ctx = ssl.create_default_context(cafile=str(srv.ca))
    port = int(domain.rsplit(":", 1)[1])
    ok = httpx.get(f"https://127.0.0.1:{port}/health", verify=ctx, trust_env=False, timeout=30)
    assert ok.status_code == 200
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as raw, \
            ctx.wrap_socket(raw, server_hostname=f"api.{domain.rsplit(':', 1)[0]}") as conn:
        assert conn.selected_alpn_protocol() == "h2"  # hypercorn: HTTP/2 by ALPN
    with httpx.Client(http2=True, verify=ctx, trust_env=False, timeout=30) as h2:
        assert h2.get(f"https://127.0.0.1:{port}/health").http_version == "HTTP/2"
    assert ok.http_version == "HTTP/1.1"  # a client offering only http/1.1 still gets it
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", trust_env=False, timeout=30)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"https://127.0.0.1:{port}/health", verify=ssl.create_default_context(), trust_env=False,
                  timeout=30)  # fmt: skip


def test_responses_name_the_domain_the_client_used(tls_server: tuple[Server, str, tuple[Server, ...]]) -> None:
    srv, domain, _ = tls_server
    assert srv.ca is not None
    port = int(domain.rsplit(":", 1)[1])
    ctx = ssl.create_default_context(cafile=str(srv.ca))
    headers = {"X-API-KEY": API_KEY}
    with httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=ctx, trust_env=False, timeout=120) as http:
        created = http.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120},
                            headers={**headers, "Host": f"api.{domain}"})  # fmt: skip
        assert created.status_code == 201, created.text
        sid = created.json()["sandboxID"]
        try:
            assert created.json()["domain"] == domain
            detail = http.get(f"/sandboxes/{sid}", headers=headers)  # Host 127.0.0.1:<port>
            assert detail.json()["domain"] == f"localhost:{port}"
        finally:
            http.delete(f"/sandboxes/{sid}", headers=headers)

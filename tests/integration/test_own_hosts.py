"""A header rule naming another sandbox's public URL (``runtime/egress_own.py``), against a real HTTPS server
with a ``sandbox_domain``: the E2B SDK's ``test_firewall_transform_injects_headers`` in small, and what it
must not open.

A sidecar sandbox serves the httpbin stand-in (tests/fixtures/httpbin.py) on 8080 with public traffic
allowed; a sandbox whose rule names ``sidecar.get_host(8080)`` (``8080-<id>.aenv.localhost:PORT``, which
curl sends to the sandbox's own loopback) gets its header there through the server's own listener, over HTTPS or plain
HTTP (the proxy speaks TLS to the listener either way). A
request on that route for another Host (the API's) or with E2B's routing headers is refused with 421; a
sandbox without the rule reaches nothing (its own loopback); a sidecar without public traffic answers
the proxy's 403, as it would an internet client without the token. Both runtimes: on vm the guest's
loopback on those ports is piped out by envd (``envd/relay.py``) to the jail, whose filter does what an ns
sandbox's does."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import Sandbox

from aenv.testing.server import API_KEY, Server, free_port, start_server, stop_server
from tests.integration.test_domain_tls import make_tls

pytestmark = pytest.mark.sdk
HTTPBIN = Path(__file__).resolve().parents[1] / "fixtures" / "httpbin.py"
TOKEN = "e2b-transform-value-123"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, runtime_name: str) -> Iterator[tuple[Server, str]]:
    if os.geteuid() != 0 or shutil.which("openssl") is None:
        pytest.skip("needs root (the ns runtime, the vm's jail) and the openssl command (the test's CA)")
    tmp = tmp_path_factory.mktemp("aenv-own-hosts")
    tls = make_tls(tmp, ["aenv.localhost", "*.aenv.localhost", "localhost"])
    port = free_port()
    domain = f"aenv.localhost:{port}"
    env = {"AENV_SANDBOX_DOMAIN": domain, "AENV_EGRESS_EXTRA_CA": str(tls.ca)}
    srv = start_server(tmp, runtime_name, extra_env=env, port=port, tls=tls)
    try:
        yield srv, domain
    finally:
        stop_server(srv)


def _sidecar(public: bool) -> Sandbox:
    sbx = Sandbox.create("base", timeout=600, network={"allow_public_traffic": public})
    sbx.files.write("/tmp/httpbin.py", HTTPBIN.read_text())
    sbx.commands.run("python3 /tmp/httpbin.py 8080", background=True, timeout=0)
    sbx.commands.run("for i in $(seq 100); do curl -sf localhost:8080/headers && exit 0; sleep 0.2; done; exit 1",
                     timeout=60)
    return sbx


def _curl(sbx: Sandbox, args: str) -> tuple[int, str]:
    """(curl's exit status, what it wrote, -w's status code last)."""
    r = sbx.commands.run(f"curl -sS --max-time 10 -w '\\n%{{http_code}}' {args}; echo \" $?\"", timeout=60)
    out, _, code = r.stdout.rstrip().rpartition(" ")
    return int(code), out


def test_a_rule_for_another_sandbox_url(server: tuple[Server, str]) -> None:
    """Run in a process of its own: the SDK's HTTP client reads ``SSL_CERT_FILE`` once per process, and an
    earlier test of the session may have made it already (without this server's CA)."""
    srv, domain = server
    assert srv.ca is not None
    env = {**{k: v for k, v in os.environ.items() if k not in ("E2B_API_URL", "E2B_SANDBOX_URL")},
           "E2B_DOMAIN": domain, "E2B_API_KEY": API_KEY, "SSL_CERT_FILE": str(srv.ca),
           "PYTHONPATH": os.pathsep.join((str(REPO), str(REPO / "src")))}  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "tests.integration.test_own_hosts", domain], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}\n--- server log ---\n{srv.log_tail()}"
    host = json.loads(proc.stdout.strip().splitlines()[-1])["host"]
    log = srv.log_path.read_text(errors="replace")
    assert f"egress to {host.rsplit(':', 1)[0]} refused" in log


def _scenario(domain: str) -> str:
    """The checks, with the SDK pointed at the server by the environment; returns the sidecar's host."""
    made: list[Sandbox] = []
    try:
        made += [sidecar := _sidecar(True), private := _sidecar(False)]
        host, closed = sidecar.get_host(8080), private.get_host(8080)
        rule = [{"transform": {"headers": {"X-Test-Token": TOKEN}}}]
        made.append(sbx := Sandbox.create("base", timeout=600, network={"rules": {host: rule, closed: rule}}))
        code, out = _curl(sbx, f"https://{host}/headers")
        assert code == 0 and out.endswith("\n200"), out
        got = json.loads(out.rsplit("\n", 1)[0])["headers"]
        assert got["X-Test-Token"] == [TOKEN] and got["Host"] == [host], got
        code, out = _curl(sbx, f"http://{host}/headers")  # plain HTTP too: the proxy speaks TLS to the listener
        assert code == 0 and json.loads(out.rsplit("\n", 1)[0])["headers"]["X-Test-Token"] == [TOKEN], out

        api = f"api.{domain}"
        for extra in (f"-H 'Host: {api}'", "-H 'E2b-Sandbox-Id: other'", f"-H 'Host: 49983-{sbx.sandbox_id}.{domain}'"):
            code, out = _curl(sbx, f"{extra} https://{host}/sandboxes")
            assert out.endswith("\n421") and "aenv egress proxy" in out, (extra, out)

        code, out = _curl(sbx, f"https://{closed}/headers")  # allowPublicTraffic false: as for any client
        assert out.endswith("\n403") and "e2b-traffic-access-token" in out, out

        made.append(bare := Sandbox.create("base", timeout=600))
        assert _curl(bare, f"https://{host}/headers")[0] == 7  # no rule: its own loopback, nothing there
        return host
    finally:
        for s in made:
            s.kill()


if __name__ == "__main__":
    print(json.dumps({"host": _scenario(sys.argv[1])}))

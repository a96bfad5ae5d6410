"""E2B's network API through the unmodified SDK against a real server, without the internet: test
hosts and a DNS server in a network namespace the test makes (tests/fixtures/policyhosts.py), the
server's sandboxes resolving names with that DNS server (``sandbox_dns``). allowOut / denyOut by IP,
CIDR and domain (``*.`` too, TLS SNI and HTTP Host), allow over deny, live updates, the traffic token,
host masking. Marked ``sdk``: it runs on vm too (AENV_TEST_RUNTIME=vm)."""

from __future__ import annotations

import os
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import ALL_TRAFFIC, Sandbox

from aenv.testing.server import API_KEY, KEEP_SANDBOXES, Server, discard_vm_state, start_server, stop_server
from tests.fixtures.policyhosts import ALLOWED, DNS, OTHER, PAIR_CIDR, PolicyHosts, policy_hosts

pytestmark = pytest.mark.sdk


@pytest.fixture(scope="module")
def hosts() -> Iterator[PolicyHosts]:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    with policy_hosts() as h:
        yield h


@pytest.fixture(scope="module")
def net_server(tmp_path_factory: pytest.TempPathFactory, runtime_name: str, hosts: PolicyHosts) -> Iterator[Server]:
    if runtime_name == "vm":
        from aenv.config import Settings
        from aenv.runtime.vm.runtime import unavailable_reason

        if (why := unavailable_reason(Settings())) is not None:
            pytest.skip(f"vm runtime unavailable: {why}")
    srv = start_server(tmp_path_factory.mktemp("aenv-net"), runtime_name, extra_env={"AENV_SANDBOX_DNS": DNS})
    keys = ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")
    old = {k: os.environ.get(k) for k in keys}
    os.environ.update({"E2B_API_URL": srv.url, "E2B_SANDBOX_URL": srv.url, "E2B_API_KEY": API_KEY})
    yield srv
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    stop_server(srv)
    discard_vm_state(srv.state_dir)


# The sandbox's client: connect, send a file's bytes, print what comes back ('' when refused/cut).
_CLIENT = """
import socket, sys
try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
    s.sendall(open(sys.argv[3], "rb").read())
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    print(out.decode(errors="replace"))
except OSError as exc:
    print("failed", exc)
"""


def _send(sbx: Sandbox, target: str, port: int, data: bytes) -> str:
    sbx.files.write("/tmp/client.py", _CLIENT)
    sbx.files.write("/tmp/payload.bin", data)
    return sbx.commands.run(f"python3 /tmp/client.py {target} {port} /tmp/payload.bin", timeout=30).stdout


def _get(sbx: Sandbox, target: str, host: str | None = None, port: int = 80) -> str:
    """An HTTP/1.0 GET from inside the sandbox; its output."""
    return _send(sbx, target, port, f"GET / HTTP/1.0\r\nHost: {host or target}\r\n\r\n".encode())


def _tls(sbx: Sandbox, target: str, sni: str) -> str:
    """A real TLS ClientHello for ``sni`` sent to ``target``:443 from inside the sandbox."""
    ctx = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    with pytest.raises(ssl.SSLWantReadError):
        ctx.wrap_bio(incoming, outgoing, server_hostname=sni).do_handshake()
    return _send(sbx, target, 443, outgoing.read())


def _resolves(sbx: Sandbox, name: str) -> bool:
    return sbx.commands.run(f"getent hosts {name} >/dev/null && echo yes; true", timeout=30).stdout.strip() == "yes"


def test_ip_and_cidr_rules_allow_wins_and_live_updates(net_server: Server, hosts: PolicyHosts) -> None:
    sbx = Sandbox.create("base", timeout=300,
                         network={"deny_out": lambda ctx: [ctx.all_traffic], "allow_out": [ALLOWED]})
    try:
        assert f"addr={ALLOWED}" in _get(sbx, ALLOWED)
        assert "addr=" not in _get(sbx, OTHER)
        assert not _resolves(sbx, "allowed.test")  # deny all, no domain: no DNS either
        info = sbx.get_info()
        assert info.network is not None and info.network.get("deny_out") == [ALL_TRAFFIC]

        sbx.update_network({"deny_out": [PAIR_CIDR], "allow_out": [OTHER]})  # a CIDR, allow wins
        assert "addr=" not in _get(sbx, ALLOWED)
        assert f"addr={OTHER}" in _get(sbx, OTHER)
        assert _resolves(sbx, "allowed.test")  # the sandbox's DNS is the test's DNS server

        sbx.update_network({})  # replaces everything: no rules left
        assert f"addr={ALLOWED}" in _get(sbx, ALLOWED) and f"addr={OTHER}" in _get(sbx, OTHER)

        sbx.update_network({"allow_internet_access": False})  # E2B: the same as denying 0.0.0.0/0
        assert "addr=" not in _get(sbx, ALLOWED)
    finally:
        sbx.kill()


def test_domain_rules_by_http_host_and_tls_sni(net_server: Server, hosts: PolicyHosts) -> None:
    sbx = Sandbox.create("base", timeout=300, network={
        "deny_out": [ALL_TRAFFIC], "allow_out": ["allowed.test", "*.wild.test"],
    })
    try:
        assert _resolves(sbx, "allowed.test")  # a domain rule keeps DNS open
        assert f"addr={ALLOWED} host=allowed.test" in _get(sbx, "allowed.test")
        assert f"addr={OTHER} host=a.wild.test" in _get(sbx, "a.wild.test")
        assert "addr=" not in _get(sbx, "other.test")
        assert "addr=" not in _get(sbx, "wild.test")  # *.wild.test is not the apex
        # a name the sandbox claims for another address goes to that name's address, never the other
        assert f"addr={ALLOWED} host=allowed.test" in _get(sbx, OTHER, host="allowed.test")
        assert f"tls addr={ALLOWED}" in _tls(sbx, ALLOWED, "allowed.test")
        assert "tls" not in _tls(sbx, OTHER, "other.test")

        sbx.update_network({"deny_out": [ALL_TRAFFIC], "allow_out": ["other.test"]})  # live
        assert "addr=" not in _get(sbx, "allowed.test")
        assert f"addr={OTHER} host=other.test" in _get(sbx, "other.test")
    finally:
        sbx.kill()


def test_traffic_token_and_host_mask(net_server: Server) -> None:
    sbx = Sandbox.create("base", timeout=300, network={
        "allow_public_traffic": False, "mask_request_host": "custom.example:${PORT}",
    })
    try:
        assert sbx.traffic_access_token
        listen = ("import socket; s = socket.create_server(('', 8080)); open('/tmp/listening', 'w').close(); "
                  "c, _ = s.accept(); open('/tmp/req.txt', 'wb').write(c.recv(65536))")
        sbx.commands.run(f'python3 -c "{listen}"', background=True)
        for _ in range(300):  # a Python start takes seconds in a vm under TCG
            if sbx.files.exists("/tmp/listening"):
                break
            time.sleep(0.1)
        url = f"{net_server.url}/"
        headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8080"}
        with httpx.Client(trust_env=False, timeout=10) as client:
            denied = client.get(url, headers=headers)
            assert denied.status_code == 403, denied.text
            wrong = client.get(url, headers={**headers, "e2b-traffic-access-token": "nope"})
            assert wrong.status_code == 403
            # the listener answers nothing (a 502): what it received is what counts
            passed = client.get(url, headers={**headers, "e2b-traffic-access-token": sbx.traffic_access_token})
            assert passed.status_code != 403
        got = sbx.files.read("/tmp/req.txt").lower()
        assert "host: custom.example:8080" in got and "e2b-traffic-access-token" not in got
        assert sbx.commands.run("echo envd-still-open").stdout.strip() == "envd-still-open"  # envd: its own token
    finally:
        sbx.kill()


def test_policy_survives_a_restart_and_is_kept_by_forks(net_server: Server, hosts: PolicyHosts, tmp_path: Path) -> None:
    sbx = Sandbox.create("base", timeout=300, network={"deny_out": [ALL_TRAFFIC], "allow_out": [ALLOWED]})
    try:
        detail = httpx.get(f"{net_server.url}/sandboxes/{sbx.sandbox_id}", headers={"X-API-KEY": API_KEY},
                           trust_env=False).json()
        assert detail["network"] == {"allowOut": [ALLOWED], "denyOut": [ALL_TRAFFIC]}
        child = httpx.post(f"{net_server.url}/sandboxes/{sbx.sandbox_id}/fork", json={"count": 1},
                           headers={"X-API-KEY": API_KEY}, trust_env=False, timeout=120).json()[0]
        kid = Sandbox.connect(child["sandbox"]["sandboxID"])
        try:
            assert f"addr={ALLOWED}" in _get(kid, ALLOWED) and "addr=" not in _get(kid, OTHER)
        finally:
            kid.kill()
    finally:
        sbx.kill()


# Tries OTHER:80 every few ms from the moment it runs, counting tries and noting any answer.
_KNOCKER = """
import os, socket, time
i = 0
while True:
    i += 1
    try:
        with socket.create_connection(("@OTHER@", 80), timeout=1) as s:
            s.sendall(b"GET / HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n")
            if b"addr=" in s.recv(4096):
                open("/tmp/reached", "a").write(f"{i}\\n")
    except OSError:
        pass
    with open("/tmp/tries.new", "w") as f:
        f.write(str(i))
    os.replace("/tmp/tries.new", "/tmp/tries")
    time.sleep(0.005)
""".replace("@OTHER@", OTHER)


def _tries(sbx: Sandbox) -> int:
    out = sbx.commands.run("cat /tmp/tries 2>/dev/null; true", timeout=30).stdout.strip()
    return int(out) if out.isdigit() else 0


def test_a_restored_process_tree_never_runs_without_the_policy(net_server: Server, hosts: PolicyHosts,
                                                               runtime_name: str) -> None:
    """A fork child whose processes are restored (CRIU on ns, a new QEMU on vm) gets a fresh
    network namespace: the policy must be in its filter before slirp gives it a way out. A process
    that knocks on a denied host every few ms from its first instant never gets an answer."""
    sbx = Sandbox.create("base", timeout=300, network={"deny_out": [ALL_TRAFFIC], "allow_out": [ALLOWED]})
    try:
        sbx.files.write("/tmp/knock.py", _KNOCKER)
        sbx.commands.run("python3 /tmp/knock.py", background=True)
        for _ in range(300):
            if _tries(sbx) > 0:
                break
            time.sleep(0.1)
        at_fork = _tries(sbx)
        assert at_fork > 0 and not sbx.files.exists("/tmp/reached")
        child = httpx.post(f"{net_server.url}/sandboxes/{sbx.sandbox_id}/fork", json={"count": 1},
                           headers={"X-API-KEY": API_KEY}, trust_env=False, timeout=300).json()[0]
        assert "sandbox" in child, child  # the fork's own error, not a KeyError
        kid = Sandbox.connect(child["sandbox"]["sandboxID"])
        try:
            moved = _tries(kid)
            if moved <= at_fork:
                time.sleep(1)
                if _tries(kid) <= moved:
                    pytest.skip("forks here keep files only (no CRIU): no process is restored")
            assert not kid.files.exists("/tmp/reached"), kid.files.read("/tmp/reached")
            if runtime_name == "ns":  # binding to absent addresses, allowed while CRIU restored, is not any more
                nonlocal_bind = kid.commands.run("cat /proc/sys/net/ipv4/ip_nonlocal_bind").stdout.strip()
                assert nonlocal_bind == "0"
            assert "addr=" not in _get(kid, OTHER) and f"addr={ALLOWED}" in _get(kid, ALLOWED)
        finally:
            kid.kill()
    finally:
        sbx.kill()


def test_policy_and_internet_switch_survive_a_restart(tmp_path: Path, runtime_name: str, hosts: PolicyHosts,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A server restart on the same state dir re-applies each sandbox's policy. A sandbox an update
    took off the internet still has its network after the restart: turning egress on again is
    allowed (the check once read 'made without a network' from the switched allowInternetAccess)."""
    if runtime_name == "vm":
        from aenv.config import Settings
        from aenv.runtime.vm.runtime import unavailable_reason

        if (why := unavailable_reason(Settings())) is not None:
            pytest.skip(f"vm runtime unavailable: {why}")
    env = {"AENV_SANDBOX_DNS": DNS, **KEEP_SANDBOXES}
    srv = start_server(tmp_path, runtime_name, extra_env=env)
    for key in ("E2B_API_URL", "E2B_SANDBOX_URL"):
        monkeypatch.setenv(key, srv.url)  # the same port after each restart
    monkeypatch.setenv("E2B_API_KEY", API_KEY)
    try:
        sbx = Sandbox.create("base", timeout=600, network={"deny_out": [ALL_TRAFFIC], "allow_out": [ALLOWED]})
        sid = sbx.sandbox_id
        assert f"addr={ALLOWED}" in _get(sbx, ALLOWED) and "addr=" not in _get(sbx, OTHER)
        stop_server(srv)
        srv = start_server(tmp_path, runtime_name, extra_env=env, port=int(srv.url.rsplit(":", 1)[1]))
        sbx = Sandbox.connect(sid)
        assert f"addr={ALLOWED}" in _get(sbx, ALLOWED) and "addr=" not in _get(sbx, OTHER)  # still in force

        sbx.update_network({"allow_internet_access": False})
        assert "addr=" not in _get(sbx, ALLOWED)
        stop_server(srv)
        srv = start_server(tmp_path, runtime_name, extra_env=env, port=int(srv.url.rsplit(":", 1)[1]))
        sbx = Sandbox.connect(sid)
        assert "addr=" not in _get(sbx, ALLOWED) and "addr=" not in _get(sbx, OTHER)  # still off
        sbx.update_network({"deny_out": [PAIR_CIDR], "allow_out": [OTHER]})  # egress back on
        assert "addr=" not in _get(sbx, ALLOWED) and f"addr={OTHER}" in _get(sbx, OTHER)
        sbx.kill()
    finally:
        stop_server(srv)
        discard_vm_state(srv.state_dir)

"""E2B's ``network.rules`` and secrets against a real server, without the internet: HTTPS echo hosts in a
network namespace the test makes (tests/fixtures/echohosts.py), their CA given to the server
(``egress_extra_ca``), the sandboxes resolving their names with the hosts' DNS server.

A rule's header, its value a stored secret, reaches echo.test over HTTPS and HTTP; other.test is not
intercepted (the sandbox sees the real certificate); bad.test's certificate does not verify, so the
sandbox's connection is cut; a secret's update applies to the next request; the rules survive pause,
resume, fork and a server restart; and the secret's value is in no log, no API answer, nothing a
snapshot wrote, and no file or environment inside a sandbox. Marked ``sdk`` (AENV_TEST_RUNTIME=vm too)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, Secret

from aenv.testing.server import API_KEY, KEEP_SANDBOXES, Server, discard_vm_state, start_server, stop_server
from tests.fixtures.echohosts import EchoHosts, hosts  # noqa: F401

pytestmark = pytest.mark.sdk

SECRET = "aenv-test-secret-" + os.urandom(8).hex()
ROTATED = SECRET + "-v2"
H = {"X-API-KEY": API_KEY}


def _server(tmp: Path, runtime: str, hosts: EchoHosts, port: int | None = None) -> Server:  # noqa: F811
    if runtime == "vm":
        from aenv.config import Settings
        from aenv.runtime.vm.runtime import unavailable_reason

        if (why := unavailable_reason(Settings())) is not None:
            pytest.skip(f"vm runtime unavailable: {why}")
    env = {"AENV_SANDBOX_DNS": hosts.dns, "AENV_EGRESS_EXTRA_CA": str(hosts.ca), **KEEP_SANDBOXES}
    return start_server(tmp, runtime, extra_env=env, port=port)


def _curl(sbx: Sandbox, url: str, extra: str = "") -> tuple[int, str]:
    r = sbx.commands.run(f"curl -sS --max-time 10 {extra} {url}; true", timeout=60)
    code = sbx.commands.run(f"curl -s -o /dev/null --max-time 10 {extra} {url}; echo $?", timeout=60).stdout.strip()
    return int(code or -1), r.stdout


def _headers(sbx: Sandbox, url: str) -> dict[str, list[str]]:
    code, out = _curl(sbx, url)
    assert code == 0, out
    return dict(json.loads(out)["headers"])


def _issuer(sbx: Sandbox, name: str) -> str:
    cmd = (f"openssl s_client -connect {name}:443 -servername {name} </dev/null 2>/dev/null "
           "| openssl x509 -noout -issuer")
    return sbx.commands.run(cmd + "; true", timeout=60).stdout


def _inside(sbx: Sandbox, needle: str) -> str:
    """Files and process environments in the sandbox holding ``needle``: its halves are joined in the
    shell, so the command that searches never writes it anywhere."""
    a, b = needle[: len(needle) // 2], needle[len(needle) // 2 :]
    cmd = (f'n="{a}""{b}"; grep -rlsF "$n" / --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev; '
           'grep -lsF "$n" /proc/[0-9]*/environ; true')
    return sbx.commands.run(cmd, user="root", timeout=300).stdout.strip()


def _on_disk(root: Path, needle: bytes) -> list[str]:
    """Files under ``root`` holding ``needle`` (the database, where secrets are kept, and the ns runtime's
    volume image, whose files are walked through its mount, left out), read in chunks."""
    found = []
    for path in root.rglob("*"):
        if not path.is_file() or path.is_symlink() or path.name.startswith("aenv.db") or path.suffix == ".btrfs":
            continue
        try:
            with path.open("rb") as f:
                tail = b""
                while chunk := f.read(1 << 20):
                    if needle in tail + chunk:
                        found.append(str(path))
                        break
                    tail = chunk[-len(needle):]
        except OSError:
            pass
    return found


def test_header_rules_with_a_secret(tmp_path: Path, runtime_name: str, hosts: EchoHosts,  # noqa: F811
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    srv = _server(tmp_path, runtime_name, hosts)
    for key in ("E2B_API_URL", "E2B_SANDBOX_URL"):
        monkeypatch.setenv(key, srv.url)
    monkeypatch.setenv("E2B_API_KEY", API_KEY)
    answers: list[str] = []
    try:
        info = Secret.create("echo-token", SECRET)
        rules = {"echo.test": [{"transform": {"headers": {"X-Token": Secret.fill("echo-token"), "X-Plain": "p"}}}],
                 "bad.test": [{"transform": {"headers": {"X-Token": Secret.fill("echo-token")}}}]}
        sbx = Sandbox.create("base", timeout=600, network={"rules": rules})
        sid = sbx.sandbox_id

        got = _headers(sbx, "https://echo.test/headers")
        assert got["X-Token"] == [SECRET] and got["X-Plain"] == ["p"]
        assert f"aenv egress CA {sid}" in _issuer(sbx, "echo.test")
        assert _headers(sbx, "http://echo.test/headers")["X-Token"] == [SECRET]
        # not a rule domain: not intercepted, the real certificate (which the sandbox does not trust)
        assert _curl(sbx, "https://other.test/headers")[0] == 60
        assert "test-public" in _issuer(sbx, "other.test")
        sbx.files.write("/tmp/public-ca.pem", hosts.ca.read_text())
        code, out = _curl(sbx, "https://other.test/headers", "--cacert /tmp/public-ca.pem")
        assert code == 0 and "X-Token" not in json.loads(out)["headers"]
        # a rule domain whose certificate does not verify upstream: cut, nothing sent
        assert _curl(sbx, "https://bad.test/headers")[0] not in (0, 60)

        Secret.update(info.secret_id, ROTATED)  # the next request has the new value
        assert _headers(sbx, "https://echo.test/headers")["X-Token"] == [ROTATED]

        detail = httpx.get(f"{srv.url}/sandboxes/{sid}", headers=H, trust_env=False)
        assert detail.json()["network"]["rules"]["echo.test"] == [{"transform": {"headers": {"X-Token": "***",
                                                                                             "X-Plain": "***"}}}]
        answers += [detail.text, httpx.get(f"{srv.url}/secrets", headers=H, trust_env=False).text]

        # a second sandbox that never sent a request: fork it, pause it (snapshots of its memory)
        quiet = Sandbox.create("base", timeout=600, network={"rules": rules})
        child = httpx.post(f"{srv.url}/sandboxes/{quiet.sandbox_id}/fork", json={"count": 1}, headers=H,
                           trust_env=False, timeout=300).json()[0]
        assert "sandbox" in child, child
        kid = Sandbox.connect(child["sandbox"]["sandboxID"])
        quiet.pause()
        assert _on_disk(tmp_path, SECRET.encode()) == [] and _on_disk(tmp_path, ROTATED.encode()) == []
        quiet = Sandbox.connect(quiet.sandbox_id)  # resumed
        assert _headers(quiet, "https://echo.test/headers")["X-Token"] == [ROTATED]
        assert _headers(kid, "https://echo.test/headers")["X-Token"] == [ROTATED]
        assert f"aenv egress CA {kid.sandbox_id}" in _issuer(kid, "echo.test")  # its own CA

        # a restart: the rules, the CA the sandbox trusts and the secret binding are all kept
        port = int(srv.url.rsplit(":", 1)[1])
        stop_server(srv)
        srv = _server(tmp_path, runtime_name, hosts, port=port)
        sbx = Sandbox.connect(sid)
        assert _headers(sbx, "https://echo.test/headers")["X-Token"] == [ROTATED]

        marker = "planted-" + os.urandom(8).hex()  # the searches find what is there
        sbx.files.write("/tmp/marker.txt", marker)
        assert "/tmp/marker.txt" in _inside(sbx, marker)
        if runtime_name == "ns":  # its files are plain files under the state dir (vm: a qcow2 the guest caches)
            assert _on_disk(tmp_path / "state", marker.encode())
        for s in (sbx, kid, quiet):
            assert _inside(s, SECRET) == "" and _inside(s, ROTATED) == ""
        log = srv.log_path.read_text(errors="replace")
        assert SECRET not in log and ROTATED not in log
        assert "egress to bad.test" in log  # the refusal is logged, by name
        for text in answers:
            assert SECRET not in text and ROTATED not in text
        for s in (sbx, kid, quiet):
            s.kill()
    finally:
        stop_server(srv)
        discard_vm_state(srv.state_dir)

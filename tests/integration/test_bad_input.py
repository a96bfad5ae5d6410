"""Hostile and malformed input through the real server: clear E2B-shaped errors, and it keeps serving."""

from __future__ import annotations

import contextlib
import struct
import tempfile
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, SandboxException

from tests.integration.conftest import API_KEY, Server


def _h(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {"X-API-KEY": API_KEY, **(extra or {})}


def _is_e2b_error(resp: httpx.Response, status: int) -> None:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["code"] == status and body["message"]


def test_control_plane_rejects_garbage(server: Server) -> None:
    with httpx.Client(base_url=server.url, headers=_h(), trust_env=False) as c:
        _garbage_is_refused(c)


def _garbage_is_refused(c: httpx.Client) -> None:
    _is_e2b_error(c.post("/v2/sandboxes", content=b"{{{", headers={"content-type": "application/json"}), 400)
    _is_e2b_error(c.post("/v2/sandboxes", json={"templateID": "no-such-template"}), 404)
    _is_e2b_error(c.post("/v2/sandboxes", json={"templateID": "base", "timeout": -1}), 400)
    _is_e2b_error(c.post("/v2/sandboxes", json={"templateID": "base", "timeout": 10**12}), 400)
    _is_e2b_error(c.post("/v2/sandboxes", json={"templateID": "base", "metadata": {"k": "v" * 10**6}}), 400)
    _is_e2b_error(c.post("/v2/sandboxes", json=[1, 2, 3]), 400)
    _is_e2b_error(c.get("/sandboxes/..%2F..%2Fetc"), 404)
    assert c.get("/health").status_code == 200


def test_envd_edge_cases(e2b_env: dict[str, str], server: Server) -> None:
    sbx = Sandbox.create("base")
    stack = contextlib.ExitStack()
    try:
        headers = {
            "E2b-Sandbox-Id": sbx.sandbox_id,
            "E2b-Sandbox-Port": "49983",
            "X-Access-Token": sbx._envd_access_token or "",  # type: ignore[attr-defined]
        }
        c = stack.enter_context(httpx.Client(base_url=server.url, headers=headers, trust_env=False))
        # Unknown pid → not_found, not a crash.
        r = c.post("/process.Process/SendSignal", json={"process": {"pid": 424242}, "signal": "SIGNAL_SIGKILL"},
                   headers={"Content-Type": "application/json", "Connect-Protocol-Version": "1"})
        assert r.status_code == 404 and r.json()["code"] == "not_found"
        # Malformed unary JSON.
        r = c.post("/filesystem.Filesystem/Stat", content=b"not json",
                   headers={"Content-Type": "application/json", "Connect-Protocol-Version": "1"})
        assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
        # A truncated stream envelope.
        r = c.post("/process.Process/Start", content=struct.pack(">BI", 0, 1000) + b"{}",
                   headers={"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"})
        assert r.status_code in (200, 400)
        # Missing token → 401.
        r = httpx.post(server.url + "/filesystem.Filesystem/Stat", json={"path": "/"},
                       headers={**headers, "X-Access-Token": "wrong", "Content-Type": "application/json"}, trust_env=False)
        assert r.status_code == 401
        # Path traversal in /files resolves inside the sandbox, never to the host.
        marker = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="aenv-host-"))) / "secret.txt"
        marker.write_text("host-secret")
        r = c.get("/files", params={"path": "../../../.." + str(marker)})
        assert r.status_code == 404 and "host-secret" not in r.text
        r = c.get("/files", params={"path": "../../../../etc/os-release"})
        assert r.status_code == 200 and "bookworm" in r.text
        # Port with nothing listening → 502 "port is not open".
        r = c.get("/", headers={"E2b-Sandbox-Port": "8999"})
        assert r.status_code == 502 and "port is not open" in r.json()["message"]
        # envd's internal /init is not reachable from outside.
        assert c.post("/init", json={"accessToken": None}).status_code == 403
        # Still serving.
        assert sbx.commands.run("echo ok").stdout.strip() == "ok"
    finally:
        stack.close()
        sbx.kill()


def test_user_port_forwarding(e2b_env: dict[str, str], server: Server) -> None:
    sbx = Sandbox.create("base")
    try:
        sbx.files.write("/home/user/www/index.html", "served-from-sandbox")
        sbx.commands.run("cd /home/user/www && python3 -m http.server 8080 --bind 127.0.0.1", background=True, timeout=0)
        for _ in range(100):
            r = httpx.get(server.url + "/index.html", headers={"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8080"},
                          trust_env=False)
            if r.status_code == 200:
                break
            import time

            time.sleep(0.1)
        assert r.status_code == 200 and r.text == "served-from-sandbox"
        # Host-style routing: <port>-<id>.<domain>
        r = httpx.get(server.url + "/index.html", headers={"Host": f"8080-{sbx.sandbox_id}.aenv.local"}, trust_env=False)
        assert r.text == "served-from-sandbox"
    finally:
        sbx.kill()


def test_sandbox_killed_mid_stream(e2b_env: dict[str, str]) -> None:
    sbx = Sandbox.create("base")
    h = sbx.commands.run("while true; do echo x; sleep 0.1; done", background=True, timeout=0)
    Sandbox.kill(sbx.sandbox_id)
    with pytest.raises(SandboxException):  # the stream ends without an exit: an SDK error, never a hang
        h.wait()
    assert not sbx.is_running()

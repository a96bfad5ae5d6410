"""Auth at every door: API keys on the control plane, envd tokens on sandbox traffic, signed /files URLs.

A server with keys configured must refuse the control plane without a valid key (``401`` in the E2B
error shape, which the SDK turns into ``AuthenticationException``), leave ``/health`` open, and protect
``/metrics`` when ``metrics_public`` is off. A ``secure`` sandbox's envd must refuse calls without its
token, and ``/files`` must refuse bad, foreign and expired URL signatures.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import httpx
import pytest
from e2b import AuthenticationException, Sandbox

from aenv.core.orchestrator import file_signature
from aenv.testing.server import API_KEY, Server
from tests.reliability.helpers import ServerFactory, sdk_kwargs

OTHER_KEY = "e2b_" + "1" * 40


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, runtime_name: str) -> Iterator[Server]:
    if os.geteuid() != 0:
        pytest.skip("the ns and vm runtimes need root")
    factory = ServerFactory(tmp_path_factory.mktemp("aenv-auth"), runtime_name,
                            {"AENV_POOL_SIZE": "0", "AENV_API_KEYS": f"{API_KEY},{OTHER_KEY}",
                             "AENV_METRICS_PUBLIC": "false"})
    try:
        yield factory.start()
    finally:
        factory.close()


def test_control_plane_needs_a_key(keyed: Server) -> None:
    for headers in ({}, {"X-API-KEY": "e2b_" + "f" * 40}, {"X-API-KEY": ""}, {"Authorization": "Bearer nope"}):
        for method, path in (("GET", "/v2/sandboxes"), ("POST", "/v2/sandboxes"), ("GET", "/sandboxes/x"),
                             ("DELETE", "/sandboxes/x"), ("GET", "/templates"), ("GET", "/aenv/info"),
                             ("GET", "/metrics")):
            resp = httpx.request(method, keyed.url + path, headers=headers, json={"templateID": "base"},
                                 trust_env=False)
            assert resp.status_code == 401, (method, path, headers, resp.status_code)
            assert resp.json()["code"] == 401
    assert httpx.get(keyed.url + "/health", trust_env=False).status_code == 200
    for key in (API_KEY, OTHER_KEY):
        assert httpx.get(keyed.url + "/metrics", headers={"X-API-KEY": key}, trust_env=False).status_code == 200
    with pytest.raises(AuthenticationException):
        Sandbox.create("base", api_url=keyed.url, sandbox_url=keyed.url, api_key="e2b_" + "2" * 40)


@pytest.fixture(scope="module")
def secure(keyed: Server) -> Iterator[Sandbox]:
    sbx = Sandbox.create("base", timeout=300, secure=True, **sdk_kwargs(keyed))
    yield sbx
    sbx.kill()


def test_envd_token_enforced(keyed: Server, secure: Sandbox) -> None:
    token = secure._envd_access_token  # type: ignore[attr-defined]
    assert token
    base = {"E2b-Sandbox-Id": secure.sandbox_id, "E2b-Sandbox-Port": "49983",
            "Content-Type": "application/json", "Connect-Protocol-Version": "1"}
    for bad in ({}, {"X-Access-Token": "wrong"}, {"X-Access-Token": token[:-1]}, {"X-Access-Token": ""}):
        for path in ("/process.Process/List", "/filesystem.Filesystem/ListDir", "/envs"):
            resp = httpx.post(keyed.url + path, headers={**base, **bad}, content=b'{"path":"/"}', trust_env=False) \
                if path != "/envs" else httpx.get(keyed.url + path, headers={**base, **bad}, trust_env=False)
            assert resp.status_code == 401, (path, bad, resp.status_code, resp.text[:200])
        resp = httpx.get(keyed.url + "/files", params={"path": "/etc/hostname"}, headers={**base, **bad},
                         trust_env=False)
        assert resp.status_code == 401, (bad, resp.status_code)
    ok = httpx.post(keyed.url + "/process.Process/List", headers={**base, "X-Access-Token": token}, content=b"{}",
                    trust_env=False)
    assert ok.status_code == 200, ok.text
    # the SDK's own traffic carries the token
    assert secure.commands.run("echo authed").stdout.strip() == "authed"


def _q(params: dict[str, str]) -> str:
    return str(httpx.QueryParams(params))


def test_signed_file_urls(keyed: Server, secure: Sandbox) -> None:
    secure.files.write("/home/user/signed.txt", "for signed eyes")
    good = secure.download_url("/home/user/signed.txt")
    assert httpx.get(good, trust_env=False).text == "for signed eyes"
    token = secure._envd_access_token  # type: ignore[attr-defined]
    path, user = "/home/user/signed.txt", "user"
    cases = {
        "tampered": good.replace("signature=v1_", "signature=v1_A"),
        "other path": keyed.url + "/files?" + _q(
            {"path": "/etc/shadow", "username": user, "signature": file_signature(path, "read", user, token, None)}),
        "write sig used to read": keyed.url + "/files?" + _q(
            {"path": path, "username": user, "signature": file_signature(path, "write", user, token, None)}),
        "expired": keyed.url + "/files?" + _q(
            {"path": path, "username": user, "signature_expiration": str(int(time.time()) - 10),
             "signature": file_signature(path, "read", user, token, str(int(time.time()) - 10))}),
        "no signature": keyed.url + "/files?" + _q({"path": path, "username": user}),
    }
    for name, url in cases.items():
        resp = httpx.get(url, trust_env=False)
        assert resp.status_code in (401, 403), (name, resp.status_code, resp.text[:200])
        assert "for signed eyes" not in resp.text, name
    future = str(int(time.time()) + 600)
    fresh = keyed.url + "/files?" + _q(
        {"path": path, "username": user, "signature_expiration": future,
         "signature": file_signature(path, "read", user, token, future)})
    assert httpx.get(fresh, trust_env=False).text == "for signed eyes"

"""The sandbox domain in API responses (serialize.domain_for, set per request by the app) and the round
trip it exists for: the host the E2B SDK's ``get_host(port)`` builds from it is routed by the proxy to that
port of that sandbox, and ``api.<domain>`` (the SDK's control plane with only ``E2B_DOMAIN`` set) is not.
"""

from __future__ import annotations

from typing import Any

import pytest
from e2b.connection_config import ConnectionConfig
from starlette.testclient import TestClient

from aenv.api import serialize
from aenv.api.app import create_app
from aenv.api.proxy import route
from aenv.config import Settings
from tests.fixtures.runtime import FakeRuntime

API = {"X-API-KEY": "e2b_" + "0" * 40}


@pytest.mark.parametrize(
    ("host", "server_port", "configured", "domain"),
    [
        (b"127.0.0.1:8000", 8000, None, "localhost:8000"),
        (b"localhost:9000", 8000, None, "localhost:9000"),  # the port the client named (a forwarded one)
        (b"[::1]:8000", 8000, None, "localhost:8000"),
        (b"[::1]", 443, None, "localhost"),  # no port named: the scheme's own
        (b"example.com", 80, None, "localhost"),
        (b"API.aenv.localhost:8443", 8443, None, "aenv.localhost:8443"),  # E2B_DOMAIN=aenv.localhost:8443
        (b"api.sbx.example.com", 443, None, "sbx.example.com"),
        (None, 8123, None, "localhost:8123"),  # no Host at all: the port it reached
        (b"127.0.0.1:8000", 8000, "sbx.example.com:8443", "sbx.example.com:8443"),
    ],
)
def test_domain_for(host: bytes | None, server_port: int, configured: str | None, domain: str) -> None:
    headers = [(b"host", host)] if host is not None else []
    assert serialize.domain_for(headers, server_port, configured) == domain


@pytest.mark.parametrize("domain", ["localhost:8000", "localhost", "aenv.localhost:8443", "sbx.example.com"])
@pytest.mark.parametrize("port", [8000, 49983, 3000])
def test_the_sdks_get_host_names_are_routed_and_its_api_host_is_not(domain: str, port: int) -> None:
    host = ConnectionConfig(domain=domain, api_key="k").get_host("i9d309b0881b64b32b38", domain, port)
    assert route({"headers": [(b"host", host.encode())]}) == ("i9d309b0881b64b32b38", port)
    api_host = ConnectionConfig(domain=domain, api_key="k").api_url.removeprefix("https://")
    assert route({"headers": [(b"host", api_host.encode())]}) is None


def _create(client: TestClient, host: str) -> Any:
    res = client.post("/v2/sandboxes", json={"templateID": "base"}, headers={**API, "host": host})
    assert res.status_code == 201, res.text
    return res.json()


def test_create_connect_and_detail_carry_the_domain(client: TestClient) -> None:
    created = _create(client, "127.0.0.1:8000")
    assert created["domain"] == "localhost:8000"
    sid = created["sandboxID"]
    detail = client.get(f"/sandboxes/{sid}", headers={**API, "host": "api.aenv.localhost:8443"}).json()
    assert detail["domain"] == "aenv.localhost:8443"
    connected = client.post(f"/v2/sandboxes/{sid}/connect", json={"timeout": 60},
                            headers={**API, "host": "localhost:9000"})  # fmt: skip
    assert connected.status_code in (200, 201) and connected.json()["domain"] == "localhost:9000"
    assert "domain" not in client.get("/v2/sandboxes", headers=API).json()[0]  # not part of E2B's listing


def test_a_configured_domain_wins(settings: Settings, runtime: FakeRuntime, tmp_path: Any) -> None:
    app = create_app(settings.model_copy(update={"sandbox_domain": "sbx.example.com"}), runtime=runtime,  # type: ignore[arg-type]
                     ensure_base=False)  # fmt: skip
    with TestClient(app) as c:
        app.app.state.catalog.register(alias="base", kind="bootstrap", rootfs=tmp_path / "rootfs", template_id="base")
        assert _create(c, "127.0.0.1:8000")["domain"] == "sbx.example.com"

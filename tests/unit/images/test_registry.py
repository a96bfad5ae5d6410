from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import pytest

from aenv.images import manifest as m
from aenv.images.errors import (
    AuthRequired,
    DigestMismatch,
    ManifestNotFound,
    RegistryProtocolError,
    RegistryUnavailable,
)
from aenv.images.reference import parse_reference
from aenv.images.registry import RegistryClient
from tests.fixtures.fakes import FakeRegistry, layer_with, sha


async def test_resolve_and_download(fake_registry: FakeRegistry, tmp_path: Path) -> None:
    layer = layer_with("a.txt", b"hello")
    digest = fake_registry.add_image("library/ubuntu", "22.04", [layer])
    async with fake_registry.client() as c:
        r = await c.resolve(parse_reference("ubuntu:22.04"))
        assert r.manifest_digest == digest
        assert str(r.reference).endswith(f"ubuntu:22.04@{digest}")
        dest = tmp_path / "blob"
        seen: list[int] = []
        await c.download_blob(r.reference, r.manifest.layers[0], dest, on_bytes=seen.append)
        assert dest.read_bytes() == layer and seen[-1] == len(layer)


async def test_unknown_tag_names_reference(fake_registry: FakeRegistry) -> None:
    async with fake_registry.client() as c:
        with pytest.raises(ManifestNotFound) as e:
            await c.resolve(parse_reference("ubuntu:99.99"))
    assert "docker.io/library/ubuntu:99.99" in str(e.value)
    assert e.value.reference == "docker.io/library/ubuntu:99.99"


async def test_digest_mismatch_removes_file(fake_registry: FakeRegistry, tmp_path: Path) -> None:
    layer = layer_with("a.txt", b"x" * 100)
    fake_registry.add_image("library/a", "1", [layer])
    fake_registry.corrupt.add(sha(layer))
    async with fake_registry.client() as c:
        r = await c.resolve(parse_reference("a:1"))
        dest = tmp_path / "blob"
        with pytest.raises(DigestMismatch) as e:
            await c.download_blob(r.reference, r.manifest.layers[0], dest)
    assert not dest.exists()
    assert e.value.expected == sha(layer) and "docker.io/library/a:1" in str(e.value)


async def test_oversized_blob_is_cut_off(fake_registry: FakeRegistry, tmp_path: Path) -> None:
    layer = layer_with("a.txt", b"y" * 1000)
    fake_registry.add_image("library/a", "1", [layer])
    async with fake_registry.client() as c:
        r = await c.resolve(parse_reference("a:1"))
        lying = m.Descriptor(r.manifest.layers[0].media_type, sha(layer), 10)
        with pytest.raises(DigestMismatch, match="more than 10 bytes"):
            await c.download_blob(r.reference, lying, tmp_path / "b")
    assert not (tmp_path / "b").exists()


async def test_retries_5xx_then_succeeds(fake_registry: FakeRegistry) -> None:
    fake_registry.add_image("library/a", "1", [layer_with("f", b"1")])
    fake_registry.fail_next = 2
    async with fake_registry.client(attempts=3) as c:
        await c.resolve(parse_reference("a:1"))


async def test_retries_exhausted_is_unavailable(fake_registry: FakeRegistry) -> None:
    fake_registry.fail_next = 100
    delays: list[float] = []

    async def sleep(d: float) -> None:
        delays.append(d)

    async with fake_registry.client(attempts=4, sleep=sleep) as c:
        with pytest.raises(RegistryUnavailable) as e:
            await c.resolve(parse_reference("a:1"))
    assert e.value.context["attempts"] == 4
    assert delays == [0.25, 0.5, 1.0]  # exponential backoff between the 4 attempts
    assert "docker.io/library/a:1" in str(e.value)


async def test_connection_refused_is_unavailable() -> None:
    def boom(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    async def sleep(_: float) -> None:
        return None

    async with RegistryClient(transport=httpx.MockTransport(boom), attempts=3, sleep=sleep) as c:
        with pytest.raises(RegistryUnavailable, match="3 attempt"):
            await c.resolve(parse_reference("ghcr.io/x/y:1"))


async def test_bearer_token_flow(fake_registry: FakeRegistry) -> None:
    fake_registry.token = "tok123"
    fake_registry.add_image("library/a", "1", [layer_with("f", b"1")])
    async with fake_registry.client() as c:
        await c.resolve(parse_reference("a:1"))
        before = fake_registry.requests
        await c.resolve(parse_reference("a:1"))
        assert fake_registry.requests - before == 1  # token cached: no second 401 round trip


async def test_basic_auth_from_credentials_file(tmp_path: Path) -> None:
    creds = tmp_path / "auth.json"
    creds.write_text(json.dumps({"auths": {"reg.test": {"auth": base64.b64encode(b"u:p").decode()}}}))
    want = "Basic " + base64.b64encode(b"u:p").decode()

    def handler(request: httpx.Request) -> httpx.Response:
        if request.headers.get("authorization") != want:
            return httpx.Response(401, headers={"WWW-Authenticate": 'Basic realm="r"'})
        return httpx.Response(404)

    async with RegistryClient(transport=httpx.MockTransport(handler), credentials_file=creds) as c:
        with pytest.raises(ManifestNotFound):  # got past auth
            await c.resolve(parse_reference("reg.test/a:1"))
    async with RegistryClient(
        transport=httpx.MockTransport(handler), credentials_file=tmp_path / "none"
    ) as c:
        with pytest.raises(AuthRequired, match="reg.test/a:1"):
            await c.resolve(parse_reference("reg.test/a:1"))


async def test_index_selects_amd64_and_checks_digest(fake_registry: FakeRegistry) -> None:
    d = fake_registry.add_image("library/a", "single", [layer_with("f", b"1")])
    raw, _ = fake_registry.manifests[("library/a", d)]
    index = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": m.OCI_INDEX,
            "manifests": [
                {
                    "mediaType": m.OCI_MANIFEST,
                    "digest": "sha256:" + "0" * 64,
                    "size": 1,
                    "platform": {"os": "linux", "architecture": "arm64"},
                },
                {
                    "mediaType": m.OCI_MANIFEST,
                    "digest": d,
                    "size": len(raw),
                    "platform": {"os": "linux", "architecture": "amd64"},
                },
            ],
        }
    ).encode()
    fake_registry.manifests[("library/a", "multi")] = (index, m.OCI_INDEX)
    async with fake_registry.client() as c:
        r = await c.resolve(parse_reference("a:multi"))
        assert r.manifest_digest == d
        # a manifest fetched by digest must hash to it
        fake_registry.manifests[("library/a", d)] = (raw + b" ", m.OCI_MANIFEST)
        with pytest.raises(DigestMismatch):
            await c.resolve(parse_reference("a:multi"))


async def test_manifest_size_is_bounded(fake_registry: FakeRegistry) -> None:
    fake_registry.manifests[("library/a", "big")] = (
        b"{" + b" " * (m.MAX_MANIFEST_BYTES + 10) + b"}",
        m.OCI_MANIFEST,
    )
    async with fake_registry.client() as c:
        with pytest.raises(RegistryProtocolError, match="larger than"):
            await c.resolve(parse_reference("a:big"))


def test_endpoints() -> None:
    c = RegistryClient(mirrors={"docker.io": "http://127.0.0.1:5000/"}, insecure=["reg.lan:5000"])
    assert c.base_url(parse_reference("ubuntu")) == "http://127.0.0.1:5000"
    assert c.base_url(parse_reference("reg.lan:5000/a")) == "http://reg.lan:5000"
    assert c.base_url(parse_reference("ghcr.io/a/b")) == "https://ghcr.io"
    assert c.base_url(parse_reference("localhost:5000/a")) == "http://localhost:5000"
    assert RegistryClient().base_url(parse_reference("ubuntu")) == "https://registry-1.docker.io"

"""Async OCI distribution client on httpx: manifests, blobs (digest-verified), token auth, mirrors, push.

The one seam where httpx exceptions and registry status codes become ``aenv.images.errors`` types is
``RegistryClient._request`` (+ ``_raise_for_status``); nothing else here catches httpx errors. Every read
from the network is bounded: manifests and configs by a byte cap, blobs by the size in their descriptor.
Blobs are streamed into a caller-chosen temp path and hashed on the way; on a mismatch the temp file is
deleted and ``DigestMismatch`` raised, so the cache never renames an unverified blob into place.

Mirrors replace the endpoint of a registry (``docker.io → http://127.0.0.1:5000``); repository paths are
unchanged (``library/ubuntu``), as with Docker's ``registry-mirrors``. There is no fallback to the
upstream registry: offline hosts cannot reach it and the retries would only delay a clear error.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import ipaddress
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from aenv.faults import fault_point
from aenv.images import manifest as m
from aenv.images.auth import Credentials, load_credentials, parse_challenge
from aenv.images.errors import (
    AuthRequired,
    DigestMismatch,
    ManifestNotFound,
    RegistryProtocolError,
    RegistryUnavailable,
)
from aenv.images.reference import Reference

log = logging.getLogger(__name__)

CHUNK = 256 * 1024
_RETRY_STATUS = {429, 500, 502, 503, 504}


@dataclass(frozen=True)
class ResolvedImage:
    """A manifest resolved to one platform, plus the digest of that manifest."""

    reference: Reference  # with .digest set to the platform manifest's digest
    manifest: m.Manifest
    manifest_digest: str
    manifest_bytes: bytes


def _is_loopback(host: str) -> bool:
    name = host.rsplit(":", 1)[0].strip("[]") if host.count(":") <= 1 or host.startswith("[") else host
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def sha256_hex(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class RegistryClient:
    """One client per server (connection pool, token cache). Close with ``aclose``."""

    def __init__(
        self,
        *,
        mirrors: dict[str, str] | None = None,
        insecure: list[str] | None = None,
        credentials_file: Path | None = None,
        attempts: int = 4,
        backoff: float = 0.25,
        max_backoff: float = 4.0,
        timeout: float = 60.0,
        transport: httpx.AsyncBaseTransport | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.mirrors = {k: v.rstrip("/") for k, v in (mirrors or {}).items()}
        self.insecure = set(insecure or ())
        self.credentials_file = credentials_file
        self.attempts = max(1, attempts)
        self.backoff = backoff
        self.max_backoff = max_backoff
        self._sleep = sleep
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=10.0),
            follow_redirects=True,
            transport=transport,
            limits=httpx.Limits(max_connections=16, max_keepalive_connections=8),
        )
        self._tokens: dict[tuple[str, str], str] = {}
        self._basic: dict[str, Credentials] = {}

    @classmethod
    def from_settings(cls, settings: Any, **kw: Any) -> RegistryClient:
        """Mirrors and insecure hosts from Settings; credentials file from ``$AENV_REGISTRY_AUTH_FILE``."""
        kw.setdefault("credentials_file", _env_credentials_file())
        return cls(mirrors=dict(settings.registry_mirrors), insecure=list(settings.insecure_registries), **kw)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> RegistryClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- endpoints -----------------------------------------------------------------------------------

    def base_url(self, ref: Reference) -> str:
        """Scheme + host of the API endpoint for ``ref`` after applying mirrors and insecure rules."""
        mirror = self.mirrors.get(ref.registry)
        if mirror:
            if "://" in mirror:
                return mirror
            host = mirror
        else:
            host = ref.api_host
        scheme = (
            "http"
            if (host in self.insecure or ref.registry in self.insecure or _is_loopback(host))
            else "https"
        )
        return f"{scheme}://{host}"

    def _url(self, ref: Reference, kind: str, ident: str) -> str:
        return f"{self.base_url(ref)}/v2/{ref.repository}/{kind}/{ident}"

    # -- the error seam ------------------------------------------------------------------------------

    async def _request(
        self,
        ref: Reference,
        method: str,
        url: str,
        *,
        actions: str = "pull",
        headers: dict[str, str] | None = None,
        body: Callable[[], bytes | AsyncIterator[bytes]] | None = None,
        stream: bool = False,
    ) -> httpx.Response:
        """Send with auth, retrying connection errors, 429 and 5xx with exponential backoff.

        Returns the (possibly streaming) response for any status < 500 that is not an auth failure;
        the caller maps 404 and friends through ``_raise_for_status``.
        """
        last = ""
        authed_once = False
        attempt = 0
        while True:
            attempt += 1
            hdrs = dict(headers or {})
            auth = self._auth_header(ref, actions)
            if auth:
                hdrs["Authorization"] = auth
            try:
                req = self._http.build_request(
                    method, url, headers=hdrs, content=body() if body is not None else None
                )
                resp = await self._http.send(req, stream=True)
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            else:
                if resp.status_code == 401 and not authed_once:
                    await resp.aclose()
                    authed_once = True
                    await self._authenticate(ref, actions, resp)
                    attempt -= 1  # the auth round trip is not a failed attempt
                    continue
                if resp.status_code in (401, 403):
                    text = await self._bounded_text(resp)
                    raise AuthRequired(str(ref), f"HTTP {resp.status_code} {text}".strip())
                if resp.status_code in _RETRY_STATUS:
                    last = f"HTTP {resp.status_code}"
                    await resp.aclose()
                else:
                    if not stream:
                        try:
                            await resp.aread()
                        except httpx.TransportError as exc:
                            last = f"{type(exc).__name__}: {exc}"
                            await resp.aclose()
                            if attempt >= self.attempts:
                                raise RegistryUnavailable(str(ref), last, attempt) from exc
                            await self._sleep(min(self.max_backoff, self.backoff * 2 ** (attempt - 1)))
                            continue
                    return resp
            if attempt >= self.attempts:
                raise RegistryUnavailable(str(ref), f"{last} ({self.base_url(ref)})", attempt)
            delay = min(self.max_backoff, self.backoff * 2 ** (attempt - 1))
            log.info("registry retry ref=%s attempt=%d delay=%.2fs cause=%s", ref, attempt, delay, last)
            await self._sleep(delay)

    @staticmethod
    async def _bounded_text(resp: httpx.Response, limit: int = 2048) -> str:
        try:
            buf = b""
            async for chunk in resp.aiter_bytes():
                buf += chunk
                if len(buf) >= limit:
                    break
            return buf[:limit].decode(errors="replace").strip()
        except httpx.HTTPError:
            return ""
        finally:
            await resp.aclose()

    async def _raise_for_status(self, ref: Reference, resp: httpx.Response, what: str) -> None:
        if resp.status_code < 400:
            return
        text = await self._bounded_text(resp, 512)
        if resp.status_code == 404:
            if what == "manifest":
                raise ManifestNotFound(str(ref), "unknown repository, tag or digest")
            raise RegistryProtocolError(str(ref), f"{what} not found on the registry (HTTP 404)")
        raise RegistryProtocolError(str(ref), f"{what}: HTTP {resp.status_code} {text}".strip())

    # -- auth ----------------------------------------------------------------------------------------

    def _scope(self, ref: Reference, actions: str) -> str:
        return f"repository:{ref.repository}:{actions}"

    def _auth_header(self, ref: Reference, actions: str) -> str | None:
        host = self.base_url(ref)
        token = self._tokens.get((host, self._scope(ref, actions)))
        if token:
            return f"Bearer {token}"
        creds = self._basic.get(host)
        if creds:
            return "Basic " + base64.b64encode(f"{creds.username}:{creds.password}".encode()).decode()
        return None

    async def _authenticate(self, ref: Reference, actions: str, resp: httpx.Response) -> None:
        host = self.base_url(ref)
        challenge = parse_challenge(resp.headers.get("www-authenticate", ""))
        creds = load_credentials(ref.registry, self.credentials_file)
        if challenge is None:
            raise AuthRequired(str(ref), "401 without a WWW-Authenticate challenge")
        if challenge.scheme == "basic":
            if creds is None:
                raise AuthRequired(str(ref), "registry wants basic auth and no credentials are configured")
            self._basic[host] = creds
            return
        if challenge.scheme != "bearer" or "realm" not in challenge.params:
            raise AuthRequired(str(ref), f"unsupported auth challenge '{challenge.scheme}'")
        scope = self._scope(ref, actions)
        params = {"scope": challenge.params.get("scope") or scope}
        if challenge.params.get("service"):
            params["service"] = challenge.params["service"]
        auth = httpx.BasicAuth(creds.username, creds.password) if creds else None
        try:
            tresp = await self._http.get(challenge.params["realm"], params=params, auth=auth)
        except httpx.TransportError as exc:
            raise RegistryUnavailable(str(ref), f"token endpoint: {exc}") from exc
        if tresp.status_code != 200:
            raise AuthRequired(str(ref), f"token endpoint answered HTTP {tresp.status_code}")
        try:
            doc = tresp.json()
            token = doc.get("token") or doc.get("access_token")
        except ValueError:
            token = None
        if not token:
            raise AuthRequired(str(ref), "token endpoint returned no token")
        self._tokens[(host, scope)] = str(token)

    # -- manifests -----------------------------------------------------------------------------------

    async def _fetch_manifest(self, ref: Reference, ident: str) -> tuple[bytes, str | None, str]:
        resp = await self._request(
            ref, "GET", self._url(ref, "manifests", ident), headers={"Accept": m.ACCEPT}, stream=True
        )
        await self._raise_for_status(ref, resp, "manifest")
        data = await self._read_bounded(ref, resp, m.MAX_MANIFEST_BYTES, "manifest")
        digest = sha256_hex(data)
        if ident.startswith("sha256:") and digest != ident:
            raise DigestMismatch(str(ref), ident, digest)
        return data, resp.headers.get("content-type"), digest

    async def _read_bounded(self, ref: Reference, resp: httpx.Response, limit: int, what: str) -> bytes:
        buf = bytearray()
        try:
            async for chunk in resp.aiter_bytes():
                buf += chunk
                if len(buf) > limit:
                    raise RegistryProtocolError(str(ref), f"{what} larger than {limit} bytes")
        except httpx.TransportError as exc:
            raise RegistryUnavailable(str(ref), f"reading {what}: {exc}") from exc
        finally:
            await resp.aclose()
        return bytes(buf)

    async def resolve(self, ref: Reference) -> ResolvedImage:
        """Manifest for linux/amd64 (following an index), its digest and the raw bytes."""
        data, ctype, digest = await self._fetch_manifest(ref, ref.ref)
        doc = m.load_json(data, str(ref))
        mt = m.detect_media_type(doc, ctype)
        if mt in m.INDEX_TYPES:
            desc = m.select_platform(doc, str(ref))
            data, ctype, digest = await self._fetch_manifest(ref, desc.digest)
            doc = m.load_json(data, str(ref))
            mt = m.detect_media_type(doc, ctype)
        if mt not in m.MANIFEST_TYPES:
            raise RegistryProtocolError(
                str(ref), f"unsupported manifest type '{mt or doc.get('schemaVersion')}'"
            )
        return ResolvedImage(ref.with_digest(digest), m.parse_manifest(doc, str(ref)), digest, data)

    # -- blobs ---------------------------------------------------------------------------------------

    async def get_blob_bytes(
        self, ref: Reference, desc: m.Descriptor, limit: int = m.MAX_CONFIG_BYTES
    ) -> bytes:
        """Small blob (image config) into memory, size-capped and digest-verified."""
        if desc.size > limit:
            raise RegistryProtocolError(str(ref), f"blob {desc.digest} is {desc.size} bytes (> {limit})")
        resp = await self._request(ref, "GET", self._url(ref, "blobs", desc.digest), stream=True)
        await self._raise_for_status(ref, resp, f"blob {desc.digest}")
        data = await self._read_bounded(ref, resp, desc.size, f"blob {desc.digest}")
        actual = sha256_hex(data)
        if actual != desc.digest:
            raise DigestMismatch(str(ref), desc.digest, actual)
        return data

    async def download_blob(
        self,
        ref: Reference,
        desc: m.Descriptor,
        dest: Path,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        """Stream a blob into ``dest`` (a temp path the caller renames), verifying size and sha256.

        A connection dropped mid-body restarts the download (within the retry budget). On mismatch
        ``dest`` is removed before ``DigestMismatch`` is raised.
        """
        if not desc.digest.startswith("sha256:"):
            raise RegistryProtocolError(str(ref), f"unsupported digest algorithm in {desc.digest}")
        for attempt in range(1, self.attempts + 1):
            resp = await self._request(ref, "GET", self._url(ref, "blobs", desc.digest), stream=True)
            await self._raise_for_status(ref, resp, f"blob {desc.digest}")
            h = hashlib.sha256()
            n = 0
            try:
                with open(dest, "wb") as fh:
                    async for chunk in resp.aiter_bytes(CHUNK):
                        n += len(chunk)
                        if n > desc.size:
                            raise DigestMismatch(str(ref), desc.digest, f"more than {desc.size} bytes")
                        h.update(chunk)
                        fh.write(chunk)
                        fault_point("pull.layer")
                        if on_bytes:
                            on_bytes(n)
            except httpx.TransportError as exc:
                dest.unlink(missing_ok=True)
                if attempt >= self.attempts:
                    raise RegistryUnavailable(str(ref), f"blob {desc.digest}: {exc}", attempt) from exc
                await self._sleep(min(self.max_backoff, self.backoff * 2 ** (attempt - 1)))
                continue
            except BaseException:
                dest.unlink(missing_ok=True)
                raise
            finally:
                await resp.aclose()
            actual = "sha256:" + h.hexdigest()
            if actual != desc.digest or n != desc.size:
                dest.unlink(missing_ok=True)
                raise DigestMismatch(str(ref), desc.digest, actual if actual != desc.digest else f"{n} bytes")
            return

    async def get_blob_range(self, ref: Reference, digest: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a blob by HTTP ``Range`` (a 206 is required: a registry that sends the
        whole blob instead is refused). After a redirect httpx re-sends the header. The caller checks
        the bytes (lazy chunks carry their own sha256)."""
        if end <= start:
            return b""
        resp = await self._request(
            ref,
            "GET",
            self._url(ref, "blobs", digest),
            headers={"Range": f"bytes={start}-{end - 1}"},
            stream=True,
        )
        if resp.status_code == 200:
            await resp.aclose()
            raise RegistryProtocolError(str(ref), f"blob {digest}: the registry ignores Range (HTTP 200)")
        if resp.status_code != 206:
            await self._raise_for_status(ref, resp, f"blob {digest}")
            await resp.aclose()
            raise RegistryProtocolError(str(ref), f"blob {digest} range: HTTP {resp.status_code}")
        data = await self._read_bounded(ref, resp, end - start, f"blob {digest} range")
        if len(data) != end - start:
            raise RegistryProtocolError(
                str(ref), f"blob {digest}: {len(data)} bytes for a {end - start} range"
            )
        return data

    async def get_manifest_raw(self, ref: Reference, ident: str, accept: str) -> tuple[bytes, str]:
        """A manifest (or a referrers index) as raw bytes with its digest; ``ManifestNotFound`` on 404."""
        resp = await self._request(
            ref, "GET", self._url(ref, "manifests", ident), headers={"Accept": accept}, stream=True
        )
        await self._raise_for_status(ref, resp, "manifest")
        data = await self._read_bounded(ref, resp, m.MAX_MANIFEST_BYTES, "manifest")
        return data, sha256_hex(data)

    async def get_referrers(
        self, ref: Reference, digest: str, artifact_type: str
    ) -> list[m.Descriptor] | None:
        """The referrers API; None where the registry has none (404), so the caller uses the tag fallback."""
        url = f"{self.base_url(ref)}/v2/{ref.repository}/referrers/{digest}?artifactType={artifact_type}"
        resp = await self._request(ref, "GET", url, headers={"Accept": m.OCI_INDEX}, stream=True)
        if resp.status_code == 404:
            await resp.aclose()
            return None
        await self._raise_for_status(ref, resp, "referrers")
        doc = m.load_json(await self._read_bounded(ref, resp, m.MAX_MANIFEST_BYTES, "referrers"), str(ref))
        return [
            m.Descriptor.from_json(d, str(ref))
            for d in doc.get("manifests") or []
            if d.get("artifactType") == artifact_type
        ]

    # -- push (used by test fixtures and bench) ------------------------------------------------------

    async def blob_exists(self, ref: Reference, digest: str) -> bool:
        resp = await self._request(ref, "HEAD", self._url(ref, "blobs", digest), actions="pull,push")
        return resp.status_code == 200

    async def push_blob(self, ref: Reference, data: bytes | Path, digest: str | None = None) -> m.Descriptor:
        """Monolithic upload (POST then PUT ?digest=). Skips the upload when the blob already exists."""
        if isinstance(data, Path):
            size = data.stat().st_size
            if digest is None:
                h = hashlib.sha256()
                with open(data, "rb") as fh:
                    while chunk := fh.read(1 << 20):
                        h.update(chunk)
                digest = "sha256:" + h.hexdigest()
        else:
            size = len(data)
            digest = digest or sha256_hex(data)
        desc = m.Descriptor("", digest, size)
        if await self.blob_exists(ref, digest):
            return desc
        resp = await self._request(
            ref, "POST", f"{self.base_url(ref)}/v2/{ref.repository}/blobs/uploads/", actions="pull,push"
        )
        if resp.status_code != 202 or "location" not in resp.headers:
            raise RegistryProtocolError(str(ref), f"blob upload start: HTTP {resp.status_code}")
        location = str(httpx.URL(self.base_url(ref)).join(resp.headers["location"]))
        sep = "&" if "?" in location else "?"

        def body() -> bytes | AsyncIterator[bytes]:
            if isinstance(data, bytes):
                return data
            return _file_chunks(data)

        resp = await self._request(
            ref,
            "PUT",
            f"{location}{sep}digest={digest}",
            actions="pull,push",
            body=body,
            headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)},
        )
        if resp.status_code != 201:
            if resp.status_code == 400 and b"DIGEST_INVALID" in resp.content:
                raise DigestMismatch(str(ref), digest, "registry computed another digest")
            raise RegistryProtocolError(str(ref), f"blob upload: HTTP {resp.status_code} {resp.text[:300]}")
        return desc

    async def push_manifest(self, ref: Reference, body: bytes, media_type: str) -> str:
        """PUT the manifest under ``ref.tag`` (or its digest); returns the manifest digest."""
        ident = ref.tag or sha256_hex(body)
        resp = await self._request(
            ref,
            "PUT",
            self._url(ref, "manifests", ident),
            actions="pull,push",
            body=lambda: body,
            headers={"Content-Type": media_type},
        )
        if resp.status_code not in (200, 201):
            raise RegistryProtocolError(str(ref), f"manifest put: HTTP {resp.status_code} {resp.text[:300]}")
        return sha256_hex(body)


async def _file_chunks(path: Path) -> AsyncIterator[bytes]:
    with open(path, "rb") as fh:
        while chunk := await asyncio.to_thread(fh.read, 1 << 20):
            yield chunk


def _env_credentials_file() -> Path | None:
    v = os.environ.get("AENV_REGISTRY_AUTH_FILE")
    return Path(v) if v else None

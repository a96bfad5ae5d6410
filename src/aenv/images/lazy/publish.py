"""Where lazy images live: an OCI artifact next to the image in its registry, or a directory store.

Registry (OCI 1.1 artifact)::

    artifact manifest  artifactType application/vnd.aenv.lazy-rootfs.v1+json, subject = the image
                       manifest, config = the empty descriptor, layers = [index blob, data blob]
    discovery          GET /v2/<repo>/referrers/<image digest>; where that is 404 (Debian's
                       docker-registry 2.8), the spec's fallback tag ``sha256-<hex>``: an image index
                       listing the referrers, which the publisher updates (keeping other entries)

Directory store (any node-shared path) or object store (``s3://bucket[/prefix]``), the same two keys::

    <store>/lazy/<image hex>/data         written first
    <store>/lazy/<image hex>/index.json   written last: the commit (a reader that finds it finds the data)

A *source* is the JSON a reader needs to fetch ranges of the data blob: ``{"kind": "registry",
"reference", "digest"}``, ``{"kind": "dir", "path"}`` or ``{"kind": "s3", "url", "key", "endpoint",
"region"}`` (no keys: the reader takes them from its environment, as the server does).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aenv.images import manifest as m
from aenv.images.errors import ManifestNotFound, RegistryProtocolError
from aenv.images.lazy.format import MAX_INDEX_BYTES, LazyFormatError, LazyIndex, chunkify, parse_index
from aenv.images.reference import Reference
from aenv.images.registry import RegistryClient, sha256_hex

ARTIFACT_TYPE = "application/vnd.aenv.lazy-rootfs.v1+json"
INDEX_MEDIA = "application/vnd.aenv.lazy.index.v1+json"
DATA_MEDIA = "application/vnd.aenv.lazy.data.v1"
EMPTY_MEDIA = "application/vnd.oci.empty.v1+json"
EMPTY = b"{}"


@dataclass(frozen=True)
class LazyArtifact:
    index: LazyIndex
    source: dict[str, Any]
    where: str  # for messages: "registry <ref>" or "store <path>"


def fallback_tag(digest: str) -> str:
    return digest.replace(":", "-")


def _desc(media: str, digest: str, size: int, **extra: Any) -> dict[str, Any]:
    return {"mediaType": media, "digest": digest, "size": size, **extra}


async def publish_to_registry(
    client: RegistryClient, ref: Reference, subject_digest: str, subject_size: int, image: Path, work: Path
) -> LazyArtifact:
    """Chunk ``image``, push index + data + artifact manifest, update the fallback tag."""
    data_path = work / "lazy.data"
    index = await asyncio.to_thread(chunkify, image, data_path)
    try:
        await client.push_blob(ref, data_path, index.data_digest)
    finally:
        data_path.unlink(missing_ok=True)
    return await push_index(client, ref, subject_digest, subject_size, index)


async def push_index(
    client: RegistryClient, ref: Reference, subject_digest: str, subject_size: int, index: LazyIndex
) -> LazyArtifact:
    """Push (or re-push, e.g. with a prefetch list) the index of an already pushed data blob."""
    raw = index.dumps()
    idx_desc = await client.push_blob(ref, raw)
    await client.push_blob(ref, EMPTY)
    manifest = {
        "schemaVersion": 2,
        "mediaType": m.OCI_MANIFEST,
        "artifactType": ARTIFACT_TYPE,
        "config": _desc(EMPTY_MEDIA, sha256_hex(EMPTY), len(EMPTY)),
        "layers": [
            _desc(INDEX_MEDIA, idx_desc.digest, idx_desc.size),
            _desc(DATA_MEDIA, index.data_digest, index.data_size),
        ],
        "subject": _desc(m.OCI_MANIFEST, subject_digest, subject_size),
    }
    body = json.dumps(manifest, separators=(",", ":")).encode()
    digest = await client.push_manifest(
        Reference(ref.registry, ref.repository, None, None), body, m.OCI_MANIFEST
    )
    tag_ref = Reference(ref.registry, ref.repository, fallback_tag(subject_digest), None)
    entries: list[dict[str, Any]] = []
    try:
        old, _ = await client.get_manifest_raw(tag_ref, tag_ref.ref, m.OCI_INDEX)
        entries = [
            e for e in json.loads(old).get("manifests") or [] if e.get("artifactType") != ARTIFACT_TYPE
        ]
    except (ManifestNotFound, ValueError, AttributeError):
        pass
    entries.append(_desc(m.OCI_MANIFEST, digest, len(body), artifactType=ARTIFACT_TYPE))
    tag_index = json.dumps({"schemaVersion": 2, "mediaType": m.OCI_INDEX, "manifests": entries}).encode()
    await client.push_manifest(tag_ref, tag_index, m.OCI_INDEX)
    return LazyArtifact(index, registry_source(ref, index), f"registry {ref.name}")


def registry_source(ref: Reference, index: LazyIndex) -> dict[str, Any]:
    return {"kind": "registry", "reference": f"{ref.registry}/{ref.repository}", "digest": index.data_digest}


async def find_in_registry(
    client: RegistryClient, ref: Reference, subject_digest: str
) -> LazyArtifact | None:
    """The newest lazy artifact of ``subject_digest``, by referrers API or fallback tag; None if none."""
    found = await client.get_referrers(ref, subject_digest, ARTIFACT_TYPE)
    if found is None:
        tag_ref = Reference(ref.registry, ref.repository, fallback_tag(subject_digest), None)
        try:
            raw, _ = await client.get_manifest_raw(tag_ref, tag_ref.ref, m.OCI_INDEX)
        except ManifestNotFound:
            return None
        doc = m.load_json(raw, str(ref))
        found = [
            m.Descriptor.from_json(d, str(ref))
            for d in doc.get("manifests") or []
            if d.get("artifactType") == ARTIFACT_TYPE
        ]
    if not found:
        return None
    raw, _ = await client.get_manifest_raw(ref, found[-1].digest, m.OCI_MANIFEST)
    layers = [m.Descriptor.from_json(d, str(ref)) for d in m.load_json(raw, str(ref)).get("layers") or []]
    idx = next((d for d in layers if d.media_type == INDEX_MEDIA), None)
    if idx is None:
        raise RegistryProtocolError(str(ref), f"lazy artifact {found[-1].digest} has no index layer")
    try:
        index = parse_index(await client.get_blob_bytes(ref, idx, limit=MAX_INDEX_BYTES))
    except LazyFormatError as exc:
        raise RegistryProtocolError(str(ref), f"lazy index {idx.digest}: {exc}") from exc
    return LazyArtifact(index, registry_source(ref, index), f"registry {ref.name}")


# -- the directory store --------------------------------------------------------------------------


def store_dir(store: Path, subject_digest: str) -> Path:
    return store / "lazy" / subject_digest.split(":", 1)[-1]


def publish_to_dir(store: Path, subject_digest: str, image: Path) -> LazyArtifact:
    """Chunk ``image`` into ``<store>/lazy/<hex>/`` (data first, index last: the index is the commit)."""
    d = store_dir(store, subject_digest)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".data-{os.getpid()}"
    index = chunkify(image, tmp)
    os.replace(tmp, d / "data")
    write_dir_index(store, subject_digest, index)
    return LazyArtifact(index, {"kind": "dir", "path": str(d / "data")}, f"store {d}")


def write_dir_index(store: Path, subject_digest: str, index: LazyIndex) -> None:
    d = store_dir(store, subject_digest)
    tmp = d / f".index-{os.getpid()}"
    tmp.write_bytes(index.dumps())
    os.replace(tmp, d / "index.json")


def find_in_dir(store: Path, subject_digest: str) -> LazyArtifact | None:
    d = store_dir(store, subject_digest)
    try:
        raw = (d / "index.json").read_bytes()
    except FileNotFoundError:
        return None
    return LazyArtifact(parse_index(raw), {"kind": "dir", "path": str(d / "data")}, f"store {d}")


# -- the object store (s3://) ----------------------------------------------------------------------


def data_key(subject_digest: str) -> str:
    return f"lazy/{subject_digest.split(':', 1)[-1]}/data"


def index_key(subject_digest: str) -> str:
    return f"lazy/{subject_digest.split(':', 1)[-1]}/index.json"


@dataclass(frozen=True)
class ObjectStore:
    """An obstore store and how a reader elsewhere builds it again (URL, endpoint, region; no keys)."""

    store: Any
    url: str
    endpoint: str | None = None
    region: str | None = None

    def source(self, subject_digest: str) -> dict[str, Any]:
        return {"kind": "s3", "url": self.url, "key": data_key(subject_digest),
                "endpoint": self.endpoint, "region": self.region}  # fmt: skip

    def where(self, subject_digest: str) -> str:
        return f"store {self.url.rstrip('/')}/{index_key(subject_digest)}"


async def publish_to_object_store(store: ObjectStore, subject_digest: str, image: Path, work: Path) -> LazyArtifact:
    """Chunk ``image``, upload the data (multipart, streamed from the file: never whole in memory),
    then the index, which commits it."""
    import obstore

    data_path = work / "lazy.data"
    index = await asyncio.to_thread(chunkify, image, data_path)
    try:
        with data_path.open("rb") as fh:
            await obstore.put_async(store.store, data_key(subject_digest), fh, chunk_size=8 << 20, max_concurrency=4)
    finally:
        data_path.unlink(missing_ok=True)
    await write_object_index(store, subject_digest, index)
    return LazyArtifact(index, store.source(subject_digest), store.where(subject_digest))


async def write_object_index(store: ObjectStore, subject_digest: str, index: LazyIndex) -> None:
    import obstore

    await obstore.put_async(store.store, index_key(subject_digest), index.dumps())


async def find_in_object_store(store: ObjectStore, subject_digest: str) -> LazyArtifact | None:
    """The artifact committed under ``lazy/<hex>/``, None when there is none (other errors raise)."""
    import obstore

    try:
        got = await obstore.get_async(store.store, index_key(subject_digest))
        raw = bytes(await got.bytes_async())
    except FileNotFoundError:  # obstore raises its NotFoundError as one
        return None
    if len(raw) > MAX_INDEX_BYTES:
        raise LazyFormatError(f"lazy index {index_key(subject_digest)}: {len(raw)} bytes")
    return LazyArtifact(parse_index(raw), store.source(subject_digest), store.where(subject_digest))


# -- either store: what the servers use --------------------------------------------------------------

Store = Path | ObjectStore
CLAIM_STALE_S = 1800.0  # a conversion claim older than this was left by a converter that died


async def publish_to_store(store: Store, subject_digest: str, image: Path, work: Path) -> LazyArtifact:
    if isinstance(store, ObjectStore):
        return await publish_to_object_store(store, subject_digest, image, work)
    return await asyncio.to_thread(publish_to_dir, store, subject_digest, image)


async def find_in_store(store: Store, subject_digest: str) -> LazyArtifact | None:
    if isinstance(store, ObjectStore):
        return await find_in_object_store(store, subject_digest)
    return await asyncio.to_thread(find_in_dir, store, subject_digest)


def claim_key(subject_digest: str) -> str:
    return f"lazy/{subject_digest.split(':', 1)[-1]}/claim"


async def claim(store: Store, subject_digest: str, holder: str) -> bool:
    """Take the right to convert ``subject_digest`` (one converter per cluster: nodes that share the
    store and pull the same image at once convert it once). False when another holder has a fresh
    claim; a claim older than ``CLAIM_STALE_S`` is taken over."""
    body = json.dumps({"holder": holder, "at": time.time()}).encode()
    if isinstance(store, ObjectStore):
        import obstore

        try:
            await obstore.put_async(store.store, claim_key(subject_digest), body, mode="create")
            return True
        except Exception as exc:  # obstore's AlreadyExistsError (a FileExistsError on local stores)
            if "exist" not in type(exc).__name__.lower() and not isinstance(exc, FileExistsError):
                raise
        got = await obstore.get_async(store.store, claim_key(subject_digest))
        old = bytes(await got.bytes_async())
        if _claim_fresh(old):
            return False
        await obstore.put_async(store.store, claim_key(subject_digest), body)
        return True
    return await asyncio.to_thread(_claim_dir, store, subject_digest, body)


async def release_claim(store: Store, subject_digest: str) -> None:
    """Give a claim back (a failed conversion: the next pull anywhere tries again)."""
    if isinstance(store, ObjectStore):
        import obstore

        try:
            await obstore.delete_async(store.store, claim_key(subject_digest))
        except FileNotFoundError:
            pass
        return
    (store / claim_key(subject_digest)).unlink(missing_ok=True)


def _claim_fresh(raw: bytes) -> bool:
    try:
        return bool(time.time() - float(json.loads(raw)["at"]) < CLAIM_STALE_S)
    except (ValueError, KeyError, TypeError):
        return False


def _claim_dir(store: Path, subject_digest: str, body: bytes) -> bool:
    path = store / claim_key(subject_digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                if _claim_fresh(path.read_bytes()):
                    return False
                path.unlink()
            except FileNotFoundError:
                pass
            continue
        with os.fdopen(fd, "wb") as fh:
            fh.write(body)
        return True
    return False


async def delete_from_store(store: Store, subject_digest: str) -> None:
    """Remove an artifact (index first: a reader never finds an index without its data), and its claim."""
    if isinstance(store, ObjectStore):
        import obstore

        for key in (index_key(subject_digest), data_key(subject_digest), claim_key(subject_digest)):
            try:
                await obstore.delete_async(store.store, key)
            except FileNotFoundError:
                pass
        return
    d = store_dir(store, subject_digest)
    (d / "index.json").unlink(missing_ok=True)
    await asyncio.to_thread(shutil.rmtree, d, True)

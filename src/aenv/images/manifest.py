"""OCI / Docker schema2 manifest, index and image-config models: parsing and platform selection.

Kept free of I/O so every shape the registry can return is unit-tested with literal JSON. Anything we
cannot use (schema1, unknown media types, no linux/amd64 entry) becomes ``RegistryProtocolError``.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any

from aenv.images.errors import RegistryProtocolError

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"

MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
ACCEPT = ", ".join((*INDEX_TYPES, *MANIFEST_TYPES))

# layer media type → compression ("gzip", "zstd" or "none")
LAYER_TYPES: dict[str, str] = {
    "application/vnd.oci.image.layer.v1.tar": "none",
    "application/vnd.oci.image.layer.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd": "zstd",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip": "gzip",
    "application/vnd.docker.image.rootfs.diff.tar.gzip": "gzip",
    "application/vnd.docker.image.rootfs.diff.tar": "none",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip": "gzip",
}

MAX_MANIFEST_BYTES = 4 * 1024 * 1024
MAX_CONFIG_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    platform: dict[str, Any] | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str) -> Descriptor:
        try:
            return cls(str(d.get("mediaType", "")), str(d["digest"]), int(d["size"]), d.get("platform"))
        except (KeyError, TypeError, ValueError) as exc:
            raise RegistryProtocolError(where, f"bad descriptor {d!r}") from exc

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mediaType": self.media_type, "digest": self.digest, "size": self.size}
        if self.platform:
            out["platform"] = self.platform
        return out

    @property
    def compression(self) -> str:
        return LAYER_TYPES.get(self.media_type, "gzip")


@dataclass(frozen=True)
class Manifest:
    media_type: str
    config: Descriptor
    layers: tuple[Descriptor, ...]


@dataclass(frozen=True)
class ImageConfig:
    """The parts of the image config a sandbox needs."""

    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    diff_ids: tuple[str, ...] = ()
    architecture: str = "amd64"
    os: str = "linux"

    @property
    def start_cmd(self) -> str | None:
        """Entrypoint + Cmd as one shell-quoted string (None when the image declares neither)."""
        argv = [*self.entrypoint, *self.cmd]
        return shlex.join(argv) if argv else None


def load_json(data: bytes, where: str) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RegistryProtocolError(where, f"invalid JSON ({exc})") from exc
    if not isinstance(obj, dict):
        raise RegistryProtocolError(where, "JSON document is not an object")
    return obj


def detect_media_type(doc: dict[str, Any], header: str | None) -> str:
    """Prefer the document's own mediaType; fall back to the Content-Type header, then to shape."""
    mt = doc.get("mediaType") or (header or "").split(";")[0].strip()
    if mt in (*INDEX_TYPES, *MANIFEST_TYPES):
        return str(mt)
    if "manifests" in doc:
        return OCI_INDEX
    if "layers" in doc and "config" in doc:
        return OCI_MANIFEST
    return str(mt)


def parse_manifest(doc: dict[str, Any], where: str) -> Manifest:
    if doc.get("schemaVersion") != 2:
        raise RegistryProtocolError(where, f"unsupported manifest schemaVersion {doc.get('schemaVersion')}")
    try:
        config = Descriptor.from_json(doc["config"], where)
        layers = tuple(Descriptor.from_json(d, where) for d in doc["layers"])
    except (KeyError, TypeError) as exc:
        raise RegistryProtocolError(where, "manifest lacks config or layers") from exc
    for layer in layers:
        if layer.media_type and layer.media_type not in LAYER_TYPES:
            raise RegistryProtocolError(where, f"unsupported layer media type {layer.media_type}")
    return Manifest(str(doc.get("mediaType", OCI_MANIFEST)), config, layers)


def select_platform(doc: dict[str, Any], where: str, os_: str = "linux", arch: str = "amd64") -> Descriptor:
    """Pick the ``linux/amd64`` entry of an index (variant-less preferred; attestations skipped)."""
    entries = [Descriptor.from_json(d, where) for d in doc.get("manifests") or []]
    candidates = [
        e
        for e in entries
        if (e.platform or {}).get("os") == os_ and (e.platform or {}).get("architecture") == arch
    ]
    if not candidates:
        seen = sorted(
            {f"{(e.platform or {}).get('os')}/{(e.platform or {}).get('architecture')}" for e in entries}
        )
        raise RegistryProtocolError(
            where, f"no {os_}/{arch} image in index (has: {', '.join(seen) or 'none'})"
        )
    candidates.sort(key=lambda e: bool((e.platform or {}).get("variant")))
    return candidates[0]


def parse_config(doc: dict[str, Any], where: str) -> ImageConfig:
    cfg = doc.get("config") or {}
    env: dict[str, str] = {}
    for item in cfg.get("Env") or []:
        k, _, v = str(item).partition("=")
        env[k] = v
    diff_ids = tuple(str(d) for d in (doc.get("rootfs") or {}).get("diff_ids") or [])
    return ImageConfig(
        env=env,
        workdir=cfg.get("WorkingDir") or None,
        user=cfg.get("User") or None,
        entrypoint=tuple(cfg.get("Entrypoint") or ()),
        cmd=tuple(cfg.get("Cmd") or ()),
        diff_ids=diff_ids,
        architecture=str(doc.get("architecture", "amd64")),
        os=str(doc.get("os", "linux")),
    )

"""The snapshot manifest format, kept apart from what is saved.

A manifest is small JSON with a magic, a version and the digests of its layers; reads are capped and
validated so a corrupt or hostile object cannot blow up the server.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

MAGIC = "aenv-snapshot"
VERSION = 1
MAX_MANIFEST_BYTES = 1 << 20
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


class ManifestError(ValueError):
    pass


@dataclass(frozen=True)
class LayerRef:
    """One content-addressed blob: ``name`` is the runtime's label (e.g. "upper", "memory", "disk")."""

    name: str
    digest: str
    size: int


@dataclass
class Manifest:
    snapshot_id: str
    mode: str  # "full" | "filesystem"
    runtime: str
    template_id: str
    layers: list[LayerRef] = field(default_factory=list)
    parent: str | None = None
    runtime_data: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0
    name: str | None = None
    # Where each layer goes in the snapshot directory and what the server needs to adopt it
    # (``paths``, ``own_layers``, template alias, resources); see ``aenv.snapshots.publish``.
    meta: dict[str, Any] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        body = {"magic": MAGIC, "version": VERSION, **asdict(self)}
        return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Manifest:
        body = read_envelope(raw, MAGIC, VERSION, MAX_MANIFEST_BYTES, "manifest", "snapshot manifest")
        try:
            layers = [LayerRef(**layer) for layer in body["layers"]]
            for layer in layers:
                if not isinstance(layer.digest, str) or not _DIGEST.match(layer.digest):
                    raise ManifestError(f"bad layer digest {layer.digest!r}")
                if not isinstance(layer.name, str) or not isinstance(layer.size, int) or layer.size < 0:
                    raise ManifestError(f"bad layer entry {layer!r}")
            return cls(
                snapshot_id=str(body["snapshot_id"]),
                mode=str(body["mode"]),
                runtime=str(body["runtime"]),
                template_id=str(body["template_id"]),
                layers=layers,
                parent=body.get("parent"),
                runtime_data=dict(body.get("runtime_data") or {}),
                created_at=float(body.get("created_at") or 0.0),
                name=body.get("name") if isinstance(body.get("name"), str) else None,
                meta=dict(body.get("meta") or {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ManifestError):
                raise
            raise ManifestError(f"malformed manifest: {exc}") from None


def read_envelope(raw: bytes, magic: str, version: int, max_bytes: int, what: str, kind: str) -> dict[str, Any]:
    """The JSON body of a manifest read from the store, checked before any field is: its size, that it
    is JSON, its ``magic`` (an aenv ``kind``) and its ``version``; a ManifestError naming ``what`` else."""
    if len(raw) > max_bytes:
        raise ManifestError(f"{what} of {len(raw)} bytes exceeds {max_bytes}")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise ManifestError(f"{what} is not JSON: {exc}") from None
    if not isinstance(body, dict) or body.get("magic") != magic:
        raise ManifestError(f"not an aenv {kind}")
    if body.get("version") != version:
        raise ManifestError(f"unsupported {what} version {body.get('version')!r}")
    return body

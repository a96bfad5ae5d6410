"""The image pipeline: OCI registry client → shared layer cache → template rootfs; plus the ``base`` rootfs.

Server-side entry points (one ``ImageBuilder`` per server process, so concurrent pulls share downloads)::

    builder = ImageBuilder(settings)                 # owns RegistryClient + LayerCache
    tpl = await builder.pull("ubuntu:22.04", progress=callback)   # -> PulledImage
    core.templates.sandbox_image_of(tpl, template_id)  # -> runtime.base.SandboxImage (core's job)
    builder.release_image(tpl.manifest_digest)       # when its last template is deleted
    builder.cache.entries() / .usage() / .prune()    # `aenv cache ls|prune`
    ensure_base_rootfs(settings) -> Path             # the default `base` template (blocking; root)
"""

from __future__ import annotations

from aenv.images.bootstrap import aensure_base_rootfs, base_rootfs_path, ensure_base_rootfs
from aenv.images.cache import CacheEntry, CacheUsage, LayerCache, evict_periodically
from aenv.images.errors import (
    AuthRequired,
    BootstrapError,
    CacheError,
    DigestMismatch,
    InvalidReference,
    ManifestNotFound,
    RegistryProtocolError,
    RegistryUnavailable,
    UnsafeLayer,
)
from aenv.images.flatten import flatten_layers
from aenv.images.progress import ProgressCallback, PullEvent
from aenv.images.reference import Reference, normalize, parse_reference
from aenv.images.registry import RegistryClient
from aenv.images.templates import ImageBuilder, PulledImage, build_template_rootfs, load_image

__all__ = [
    "AuthRequired",
    "BootstrapError",
    "CacheEntry",
    "CacheError",
    "CacheUsage",
    "DigestMismatch",
    "ImageBuilder",
    "PulledImage",
    "InvalidReference",
    "LayerCache",
    "ManifestNotFound",
    "ProgressCallback",
    "PullEvent",
    "Reference",
    "RegistryClient",
    "RegistryProtocolError",
    "RegistryUnavailable",
    "UnsafeLayer",
    "aensure_base_rootfs",
    "base_rootfs_path",
    "build_template_rootfs",
    "ensure_base_rootfs",
    "evict_periodically",
    "flatten_layers",
    "load_image",
    "normalize",
    "parse_reference",
]

"""Image → template rootfs: resolve, fetch layers through the shared cache, add ``user``, describe it.

Result layout::

    <cache_dir>/layers/unpacked/<hex>/   shared per-layer overlay lowers (cache.py)
    <cache_dir>/images/<manifest-hex>/   image.json (reference, config, layer list) + user-layer/

The per-image directory is built under ``images/.tmp-*`` and renamed at the end, so a pull killed
midway leaves no half-template; its layers stay in the cache (unpinned) for the next attempt.
``PulledImage.lowers`` is the overlay ``lowerdir`` order (top first); for a flattened tree (VM runtime)
use ``ImageBuilder.flat_rootfs``.

Pins: the image's layers are pinned by ``image:<manifest-hex>`` once the template exists. Call
``release_image`` when the last template using the image is deleted; sandboxes that outlive it should
pin the same digests under ``sandbox:<id>`` (``LayerCache.pin``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aenv.images import manifest as m
from aenv.images.cache import LayerCache, LayerInfo, pid_alive, pull_owner
from aenv.images.flatten import flatten_layers
from aenv.images.lazy.lazyd import LazyUnavailable
from aenv.images.lazy.publish import LazyArtifact
from aenv.images.lazy.service import LazyImages
from aenv.images.progress import ProgressCallback, PullEvent, emit
from aenv.images.reference import Reference, parse_reference
from aenv.images.registry import RegistryClient, ResolvedImage
from aenv.images.users import write_user_layer

if TYPE_CHECKING:
    from aenv.config import Settings

log = logging.getLogger("aenv.images")

IMAGE_JSON = "image.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class PulledImage:
    """A pulled image ready for sandboxes. Paths are absolute; ``layers`` is bottom → top."""

    reference: str  # normalised, digest-pinned: docker.io/library/ubuntu:22.04@sha256:…
    manifest_digest: str
    path: Path  # <cache_dir>/images/<hex>
    layers: tuple[Path, ...]
    layer_digests: tuple[str, ...]
    user_layer: Path | None
    config: m.ImageConfig
    size: int  # uncompressed bytes of all layers
    download_bytes: int = 0  # compressed bytes fetched by this pull
    layers_reused: int = 0  # layers that needed no download in this pull
    seconds: float = 0.0
    lazy_root: Path | None = None  # a lazy image: its ext4 mounted read-only (the whole tree, user included)
    lazy_file: Path | None = None  # ... and that ext4 as a file on aenv-lazyd's FUSE mount (vm's raw backing)

    @property
    def lowers(self) -> tuple[Path, ...]:
        """overlayfs lowerdir order: user layer (if any), then image layers top → bottom."""
        if self.lazy_root is not None:
            return (self.lazy_root,)
        top = (self.user_layer,) if self.user_layer else ()
        return (*top, *reversed(self.layers))

    @property
    def pin_owner(self) -> str:
        return image_owner(self.manifest_digest)

    @property
    def start_cmd(self) -> str | None:
        return self.config.start_cmd

    def summary(self) -> str:
        """The CLI's closing line, e.g. ``ubuntu:22.04: 3 layers (2 reused), 80.1 MB, 1.2 s``."""
        ref = parse_reference(self.reference)
        return (
            f"{ref.short}: {len(self.layers)} layers ({self.layers_reused} reused), "
            f"{self.size / 1e6:.1f} MB, {self.seconds:.1f} s"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "reference": self.reference,
            "manifest_digest": self.manifest_digest,
            "layers": [str(p) for p in self.layers],
            "layer_digests": list(self.layer_digests),
            "user_layer": str(self.user_layer) if self.user_layer else None,
            "size": self.size,
            "lazy_root": str(self.lazy_root) if self.lazy_root else None,
            "lazy_file": str(self.lazy_file) if self.lazy_file else None,
            "config": {
                "env": self.config.env,
                "workdir": self.config.workdir,
                "user": self.config.user,
                "entrypoint": list(self.config.entrypoint),
                "cmd": list(self.config.cmd),
                "diff_ids": list(self.config.diff_ids),
            },
        }


def image_owner(manifest_digest: str) -> str:
    return f"image:{manifest_digest.split(':', 1)[-1]}"


def images_dir(settings: Settings) -> Path:
    return Path(settings.cache_dir) / "images"


def load_image(path: Path) -> PulledImage | None:
    """Read ``image.json``; None if absent, from another format, or if a layer dir is gone."""
    try:
        doc = json.loads((path / IMAGE_JSON).read_text())
    except (OSError, ValueError):
        return None
    if doc.get("format") != FORMAT_VERSION:
        return None
    layers = tuple(Path(p) for p in doc["layers"])
    if not all(p.is_dir() for p in layers):
        return None
    lazy_root = Path(doc["lazy_root"]) if doc.get("lazy_root") else None
    if lazy_root is not None and not os.path.ismount(lazy_root):
        return None  # its reader or mount is gone: the pull mounts it again
    c = doc["config"]
    cfg = m.ImageConfig(
        env=c["env"],
        workdir=c["workdir"],
        user=c["user"],
        entrypoint=tuple(c["entrypoint"]),
        cmd=tuple(c["cmd"]),
        diff_ids=tuple(c["diff_ids"]),
    )
    return PulledImage(
        doc["reference"],
        doc["manifest_digest"],
        path,
        layers,
        tuple(doc["layer_digests"]),
        Path(doc["user_layer"]) if doc["user_layer"] else None,
        cfg,
        int(doc["size"]),
        layers_reused=len(layers),
        lazy_root=lazy_root,
        lazy_file=Path(doc["lazy_file"]) if doc.get("lazy_file") else None,
    )


class ImageBuilder:
    """Long-lived (one per server): owns the registry client and the layer cache.

    ``build_template_rootfs`` below is the one-shot convenience wrapper around it.
    """

    def __init__(
        self, settings: Settings, *, client: RegistryClient | None = None, cache: LayerCache | None = None
    ) -> None:
        self.settings = settings
        self.client = client or RegistryClient.from_settings(settings)
        self.cache = cache or LayerCache.from_settings(settings)
        self.lazy = LazyImages(settings, self.client)
        self.root = images_dir(settings)
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".tmp-*"):  # .tmp-<pid>-…: only dead (or our own recycled) pids
            pid = stale.name.split("-")[1]
            if pid != str(os.getpid()) and pid_alive(pid):
                continue
            shutil.rmtree(stale, ignore_errors=True)
        self._building: dict[str, asyncio.Future[PulledImage]] = {}
        self._flat_locks: dict[str, asyncio.Lock] = {}

    async def aclose(self) -> None:
        await self.lazy.aclose()
        await self.client.aclose()
        self.cache.close()

    async def pull(
        self, reference: str | Reference, *, progress: ProgressCallback | None = None
    ) -> PulledImage:
        ref = reference if isinstance(reference, Reference) else parse_reference(reference)
        started = time.monotonic()
        emit(progress, PullEvent(str(ref), "resolving"))
        resolved = await self.client.resolve(ref)
        ref = resolved.reference
        hexd = resolved.manifest_digest.split(":", 1)[1]
        final = self.root / hexd
        existing = load_image(final)
        layers = resolved.manifest.layers
        emit(progress, PullEvent(str(ref), "resolved", "", 0, len(layers), resolved.manifest_digest))
        if existing is not None:
            for d in layers:
                emit(progress, PullEvent(str(ref), "cached", d.digest, d.size, d.size))
            self.cache.touch(existing.layer_digests)
            self.cache.pin(existing.pin_owner, existing.layer_digests)
            tpl = _replace(
                existing, reference=str(ref), layers_reused=len(layers), seconds=time.monotonic() - started
            )
            emit(progress, PullEvent(str(ref), "complete", message=tpl.summary()))
            return tpl
        shared = self._building.get(hexd)
        if shared is not None:  # the same image is being built by another pull: wait for that one
            try:
                tpl = await asyncio.shield(shared)
            except asyncio.CancelledError:
                if _cancelling():
                    raise
                return await self.pull(reference, progress=progress)  # the other pull was killed: redo
            emit(progress, PullEvent(str(ref), "complete", message=tpl.summary()))
            return _replace(tpl, reference=str(ref), layers_reused=len(layers), download_bytes=0)
        fut: asyncio.Future[PulledImage] = asyncio.get_running_loop().create_future()
        self._building[hexd] = fut
        try:
            tpl = await self._build(ref, resolved, progress, started)
        except Exception as exc:
            fut.set_exception(exc)
            fut.exception()  # mark retrieved: nobody may be waiting
            raise
        except BaseException:
            fut.cancel()
            raise
        else:
            fut.set_result(tpl)
        finally:
            self._building.pop(hexd, None)
        emit(progress, PullEvent(str(ref), "complete", message=tpl.summary()))
        return tpl

    async def _build(
        self, ref: Reference, resolved: ResolvedImage, progress: ProgressCallback | None, started: float
    ) -> PulledImage:
        if self.lazy.available:
            art = await self.lazy.find(ref, resolved.manifest_digest)
            if art is not None:
                try:
                    return await self._build_lazy(ref, resolved, art, progress, started)
                except LazyUnavailable as exc:
                    log.warning("lazy start of %s unavailable, pulling it whole: %s", ref, exc)
        tpl = await self._build_full(ref, resolved, progress, started)
        if self.lazy.available:
            self.lazy.convert_in_background(ref, resolved.manifest_digest, len(resolved.manifest_bytes),
                                            lambda: self.flat_rootfs(tpl))  # fmt: skip
        return tpl

    async def _build_lazy(
        self,
        ref: Reference,
        resolved: ResolvedImage,
        art: LazyArtifact,
        progress: ProgressCallback | None,
        started: float,
    ) -> PulledImage:
        """No layers: the config, then the lazy artifact registered with aenv-lazyd and mounted."""
        config_raw = await self.client.get_blob_bytes(ref, resolved.manifest.config)
        config = m.parse_config(m.load_json(config_raw, str(ref)), str(ref))
        emit(progress, PullEvent(str(ref), "lazy", message=f"on demand from {art.where}"))
        root = await self.lazy.root_of(resolved.manifest_digest, art)
        hexd = resolved.manifest_digest.split(":", 1)[1]
        tpl = PulledImage(str(ref), resolved.manifest_digest, self.root / hexd, (), (), None, config,
                          art.index.size, lazy_root=root, lazy_file=self.lazy.file_of(resolved.manifest_digest))  # fmt: skip
        tpl.path.mkdir(parents=True, exist_ok=True)
        tmp = tpl.path / f".{IMAGE_JSON}.{os.getpid()}"
        tmp.write_text(json.dumps(tpl.to_json(), indent=1))
        os.replace(tmp, tpl.path / IMAGE_JSON)
        return _replace(tpl, seconds=time.monotonic() - started)

    async def _build_full(
        self, ref: Reference, resolved: ResolvedImage, progress: ProgressCallback | None, started: float
    ) -> PulledImage:
        layers = resolved.manifest.layers
        config_raw = await self.client.get_blob_bytes(ref, resolved.manifest.config)
        config = m.parse_config(m.load_json(config_raw, str(ref)), str(ref))
        diff_ids: list[str | None] = list(config.diff_ids)
        if len(diff_ids) != len(layers):
            diff_ids = [None] * len(layers)
        owner = pull_owner()
        self.cache.pin(owner, [d.digest for d in layers])
        downloads_before = self.cache.bytes_downloaded
        try:
            infos: list[LayerInfo] = list(
                await asyncio.gather(
                    *(
                        self.cache.ensure_layer(self.client, ref, d, diff_id=did, progress=progress)
                        for d, did in zip(layers, diff_ids, strict=True)
                    )
                )
            )
            tpl = await asyncio.to_thread(
                self._assemble, ref, resolved.manifest_digest, infos, config, progress
            )
            self.cache.pin(tpl.pin_owner, tpl.layer_digests)
        finally:
            self.cache.unpin(owner)
        self.cache.evict()
        return _replace(
            tpl,
            download_bytes=self.cache.bytes_downloaded - downloads_before,
            layers_reused=sum(1 for i in infos if i.reused),
            seconds=time.monotonic() - started,
        )

    def _assemble(
        self,
        ref: Reference,
        manifest_digest: str,
        infos: list[LayerInfo],
        config: m.ImageConfig,
        progress: ProgressCallback | None,
    ) -> PulledImage:
        """Write user layer + image.json into a temp dir and rename it into place (blocking)."""
        hexd = manifest_digest.split(":", 1)[1]
        final = self.root / hexd
        tmp = self.root / f".tmp-{os.getpid()}-{hexd[:12]}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            layers = tuple(i.path for i in infos)
            emit(progress, PullEvent(str(ref), "user-layer"))
            needed = write_user_layer(tuple(reversed(layers)), tmp / "user-layer")
            user_layer = final / "user-layer" if needed else None
            tpl = PulledImage(
                str(ref),
                manifest_digest,
                final,
                layers,
                tuple(i.digest for i in infos),
                user_layer,
                config,
                sum(i.size for i in infos),
            )
            (tmp / IMAGE_JSON).write_text(json.dumps(tpl.to_json(), indent=1))
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.rename(tmp, final)
            except OSError:
                if load_image(final) is None:  # a broken leftover: replace it
                    shutil.rmtree(final, ignore_errors=True)
                    os.rename(tmp, final)
            return tpl
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def list_images(self) -> list[PulledImage]:
        """Every complete image in the store (skips ``.tmp-*`` builds and images missing a layer)."""
        found = (load_image(p) for p in sorted(self.root.iterdir()) if not p.name.startswith("."))
        return [t for t in found if t is not None]

    async def flat_rootfs(self, tpl: PulledImage) -> Path:
        """One merged tree of the image (``<image dir>/rootfs``), built once on demand for the VM runtime
        (its ext4 base). Costs a full copy of the image; the ns runtime never needs it."""
        dest = tpl.path / "rootfs"
        if dest.is_dir():
            return dest
        lock = self._flat_locks.setdefault(tpl.manifest_digest, asyncio.Lock())
        async with lock:
            if not dest.is_dir():
                await asyncio.to_thread(flatten_layers, tpl.lowers, dest)
        return dest

    def release_image(self, manifest_digest: str) -> None:
        """Forget an image (its template was deleted): unpin its layers and remove its small dir."""
        self.cache.unpin(image_owner(manifest_digest))
        shutil.rmtree(self.root / manifest_digest.split(":", 1)[-1], ignore_errors=True)


def _cancelling() -> bool:
    task = asyncio.current_task()
    return bool(task and task.cancelling())


def _replace(t: PulledImage, **kw: Any) -> PulledImage:
    from dataclasses import replace

    return replace(t, **kw)


async def build_template_rootfs(
    ref: str,
    *,
    settings: Settings,
    progress: ProgressCallback | None = None,
    builder: ImageBuilder | None = None,
) -> PulledImage:
    """Pull ``ref`` and return its template rootfs. Pass a long-lived ``builder`` from the server so
    concurrent pulls share downloads; without one a temporary builder is created and closed."""
    if builder is not None:
        return await builder.pull(ref, progress=progress)
    b = ImageBuilder(settings)
    try:
        return await b.pull(ref, progress=progress)
    finally:
        await b.aclose()

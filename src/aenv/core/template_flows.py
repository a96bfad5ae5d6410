"""Template flows: the ``base`` template, OCI pulls and deletes, and the image cache behind them.

Pulls go through one ``ImageBuilder`` per server (so concurrent pulls share downloads) and register the
result in the catalog only once the image is complete: a half-built template is never visible. Deleting
a template also drains the runtime's warm pools for it (they hold sandboxes of a template nobody can
ask for any more) and releases the image's layers to cache eviction when no other template uses them.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

from aenv.core.context import Context
from aenv.core.templates import sandbox_image_of
from aenv.errors import InvalidRequest, RuntimeFailure
from aenv.images import ImageBuilder, ProgressCallback, evict_periodically, parse_reference
from aenv.images.bootstrap import ensure_base_rootfs
from aenv.images.lazy.lazyd import LazyUnavailable
from aenv.images.lazy.service import lazy_name
from aenv.kinds import TemplateKind
from aenv.store.sqlite import TemplateRow

log = logging.getLogger("aenv.core")

EVICT_INTERVAL = 300.0


def default_name(reference: str) -> str:
    """`docker.io/library/ubuntu:22.04@sha256:…` → `ubuntu-22.04` (a valid template alias)."""
    ref = parse_reference(reference)
    repo = ref.repository.rsplit("/", 1)[-1]
    tag = ref.tag or "latest"
    return re.sub(r"[^a-z0-9._-]", "-", f"{repo}-{tag}".lower()) if tag != "latest" else repo.lower()


class TemplateFlows:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.builder = ImageBuilder(ctx.settings)
        self._evictor: asyncio.Task[None] | None = None
        self._prefetch_noted: set[str] = set()
        self._background: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self._evictor = asyncio.create_task(evict_periodically(self.builder.cache, EVICT_INTERVAL))
        if self.builder.lazy.available:  # aenv-lazyd killed: started again, its roots remounted
            task = asyncio.create_task(self.builder.lazy.supervise())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def ready_to_start(self, row: TemplateRow) -> None:
        """A lazy image's reader, if it died, restarted and its root remounted before a sandbox lands on it."""
        if row.config.get("lazy_file") and self.builder.lazy.available:
            await self.builder.lazy.ready()

    def note_started(self, row: TemplateRow) -> None:
        """A sandbox of ``row`` started: the first one of a lazy image records what it touched as the
        image's prefetch list (published with its index, replayed by every later cold start)."""
        digest = row.config.get("manifest_digest")
        if not row.config.get("lazy_file") or not digest or not row.source or digest in self._prefetch_noted:
            return
        self._prefetch_noted.add(digest)
        task = asyncio.create_task(self.builder.lazy.record_prefetch(parse_reference(row.source), digest))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def aclose(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._evictor is not None:
            self._evictor.cancel()
            self._evictor = None
        await self.builder.aclose()

    def ensure_base(self) -> None:
        """Register the default ``base`` template from the cached bootstrap rootfs (building it if
        missing; blocking) and ``code-interpreter-v1`` and ``docker`` if their layers are built."""
        row = self.ctx.store.get_template("base")
        if row is None or (row.kind is TemplateKind.BOOTSTRAP and not Path(row.rootfs).is_dir()):
            rootfs = ensure_base_rootfs(self.ctx.settings)
            self.ctx.templates.register(
                alias="base", kind=TemplateKind.BOOTSTRAP, rootfs=rootfs, source="debian:bookworm", template_id="base"
            )
            log.info("template base registered from %s", rootfs)
        self.ctx.templates.register_interpreter_if_built()
        self.ctx.templates.register_docker_if_built()

    async def pull(
        self,
        image: str,
        *,
        name: str | None = None,
        start_cmd: str | None = None,
        ready_cmd: str | None = None,
        cpu_count: int | None = None,
        memory_mb: int | None = None,
        progress: ProgressCallback | None = None,
        hidden: bool = False,
        owner: str = "",
    ) -> tuple[TemplateRow, str]:
        """Pull ``image`` and register it as a template; returns the row and a one-line summary.
        ``hidden``: the base of a template build, kept out of listings under an ID derived from the
        image's digest (the same image pulled again is the same template)."""
        try:
            parse_reference(image)
        except Exception as exc:
            raise InvalidRequest(f"invalid image reference '{image}': {exc}") from None
        pulled = await self.builder.pull(image, progress=progress)
        view = sandbox_image_of(pulled, "", start_cmd=start_cmd, ready_cmd=ready_cmd)
        row = self.ctx.templates.register(
            alias=None if hidden else name or default_name(image),
            template_id="image-" + pulled.manifest_digest.split(":", 1)[-1][:24] if hidden else None,
            kind=TemplateKind.IMAGE,
            rootfs=view.rootfs,
            lowers=list(view.lowers),
            config={
                "env": view.env, "workdir": view.workdir, "user": view.user,
                "start_cmd": view.start_cmd, "ready_cmd": view.ready_cmd,
                "manifest_digest": pulled.manifest_digest, "image_user": pulled.config.user,
                **({"lazy_file": str(pulled.lazy_file)} if pulled.lazy_file else {}),
                **({"hidden": True} if hidden else {}),
            },  # fmt: skip
            source=pulled.reference,
            cpu_count=cpu_count,
            memory_mb=memory_mb,
            size_bytes=pulled.size,
            owner="" if hidden else owner,  # a build's base, by image digest, is every team's
            pinned_layers=list(pulled.layer_digests),
        )
        return row, pulled.summary()

    async def delete(self, row: TemplateRow) -> None:
        """Delete an image or bootstrap template (snapshots are deleted by the snapshot flows)."""
        self.ctx.templates.delete(row.id, in_use=self.ctx.table.template_ids_in_use())
        await self.ctx.runtime.forget_template(row.id)
        digest = row.config.get("manifest_digest")
        if digest and not any(t.config.get("manifest_digest") == digest for t in self.ctx.templates.list_templates()):
            self.builder.release_image(digest)  # the last template of this image: its layers may be evicted

    def cache_listing(self) -> dict[str, Any]:
        cache = self.builder.cache
        lazy = self.builder.lazy
        names: dict[str, list[str]] = {}
        for t in self.ctx.templates.list_templates():
            if d := t.config.get("manifest_digest"):
                names.setdefault(lazy_name(d), []).append(t.alias or t.id)
        images = [{**i, "templates": names.get(i["name"], [])} for i in lazy.listing()]
        return {
            "usage": asdict(cache.usage()),
            "entries": [asdict(e) for e in cache.entries()],
            "lazy": {**lazy.describe(), "budget": self.ctx.settings.lazy_cache_bytes, "images": images},
        }

    async def pin_lazy(self, row: TemplateRow, pinned: bool) -> dict[str, Any]:
        """Keep a lazy template's every chunk local (offline use), or let them be evicted again."""
        digest = row.config.get("manifest_digest")
        if not digest or not row.config.get("lazy_file"):
            raise InvalidRequest(f"template '{row.id}' is not a lazy image: it is pulled whole, already local")
        try:
            return await self.builder.lazy.pin(digest, pinned)
        except LazyUnavailable as exc:
            raise RuntimeFailure(f"template '{row.id}': {exc}", template_id=row.id) from exc

    async def prune_cache(self, everything_unpinned: bool) -> dict[str, Any]:
        removed = await asyncio.to_thread(self.builder.cache.prune, everything_unpinned=everything_unpinned)
        return {"removed": [asdict(e) for e in removed], "freed": sum(e.size for e in removed)}

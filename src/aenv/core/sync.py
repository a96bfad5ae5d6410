"""The snapshot repository, seen from core: publish every user snapshot, resume what a crash left
unpublished, and fetch back by ID what is not here.

Publishing runs in the background once a snapshot's files are complete (the manifest is written last,
so the repository never shows half a snapshot). **How a server learns about snapshots it did not take**
(another state dir or machine sharing the bucket, or a local directory lost): lazily, by ID.
``Sandbox.create(template=<snapshot id>)`` on a name no local template has looks
``manifests/<id>.json`` up in the repository and, if found, downloads and verifies its layers and
registers it as a local snapshot + template (``fetch``); a known snapshot whose directory is gone is
fetched again the same way before a create or a rollback. Nothing lists the bucket: names are per
server, IDs are global. The image template under a snapshot is not in the repository: the fetching
server must have it (same ID, else same alias; ``base`` everywhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aenv.core.context import Context
from aenv.core.ids import is_valid_id
from aenv.errors import RuntimeFailure, StateError, TemplateNotFound
from aenv.kinds import TemplateKind
from aenv.store.sqlite import SnapshotRow, TemplateRow, now

log = logging.getLogger("aenv.core")

PUBLISH_CONCURRENCY = 1  # packing is CPU-bound (tar + zstd -T0): one at a time leaves room for sandboxes
PUBLISH_RETRY_DELAYS = (5.0, 30.0, 120.0)  # a store that is briefly away does not wait for a restart
GC_GRACE_S = 6 * 3600.0  # unreferenced layers younger than this may belong to a publish in progress


def short_error(exc: BaseException) -> str:
    """The first line of an error (obstore's carry multi-line debug dumps)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def disk_usage(path: Path) -> int:
    """Disk used by a snapshot directory. A hard-linked file (a vm snapshot's base RAM, shared with
    its template and every other snapshot of it; parent RAM layers) counts its share only."""
    total = 0
    for p in path.rglob("*"):
        with contextlib.suppress(OSError):
            st = p.lstat()
            total += st.st_blocks * 512 // max(1, st.st_nlink)
    return total


class SnapshotSync:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._publish_tasks: set[asyncio.Task[None]] = set()
        # async callable(SnapshotRow) that uploads to the repository; None: publishing is off
        self.publisher: Callable[[SnapshotRow], Awaitable[None]] | None = None
        self._publish_slots: asyncio.Semaphore | None = None
        self._fetch_lock: asyncio.Lock | None = None
        self.template_fetch: Callable[[str], Awaitable[bool]] | None = None  # template_share.py's fetch
        self.template_recheck: Callable[[TemplateRow], Awaitable[bool]] | None = None  # ... and its recheck

    async def delete(self, snapshot_id: str) -> None:
        """Take a deleted snapshot out of the repository too (published or not: a publish may be
        half-way)."""
        if self.ctx.repository is None:
            return
        try:
            await self.ctx.repository.delete(snapshot_id)
        except FileNotFoundError:
            pass
        except Exception as exc:
            log.warning("snapshot=%s could not be deleted from the repository: %s", snapshot_id, short_error(exc))

    def publish(self, row: SnapshotRow) -> None:
        """Upload ``row`` to the repository in the background (retried; re-queued at the next start)."""
        if self.publisher is None:
            return
        if self._publish_slots is None:
            self._publish_slots = asyncio.Semaphore(PUBLISH_CONCURRENCY)
        slots = self._publish_slots
        publisher = self.publisher

        async def run() -> None:
            for attempt, delay in enumerate((*PUBLISH_RETRY_DELAYS, None)):
                try:
                    async with slots:
                        if self.ctx.store.get_snapshot(row.id) is None:
                            return  # deleted while it waited
                        t0 = time.perf_counter()
                        await publisher(row)
                    self.ctx.store.update_snapshot(row.id, published=True)
                    log.info("snapshot=%s published in %.2fs", row.id, time.perf_counter() - t0)
                    return
                except Exception as exc:
                    if self.ctx.store.get_snapshot(row.id) is None:
                        log.info("snapshot=%s deleted while it was being published", row.id)
                        return
                    final = delay is None or isinstance(exc, FileNotFoundError)
                    log.warning("snapshot=%s publish to the repository failed (attempt %d; %s): %s", row.id,
                                attempt + 1, "retried at the next start" if final else f"retry in {delay:g}s",
                                short_error(exc), exc_info=log.isEnabledFor(logging.DEBUG))
                    if final or delay is None:
                        return
                await asyncio.sleep(delay)

        task = asyncio.create_task(run(), name=f"aenv-publish-{row.id}")
        self._publish_tasks.add(task)
        task.add_done_callback(self._publish_tasks.discard)

    async def publish_now(self, row: SnapshotRow) -> None:
        """Upload ``row`` and wait until it is in the repository (a published pause is recorded only
        then: ``handover.py``). Raises what the upload raised; no retries."""
        if self.publisher is None:
            raise StateError("no snapshot repository is configured (snapshot_store)")
        if self._publish_slots is None:
            self._publish_slots = asyncio.Semaphore(PUBLISH_CONCURRENCY)
        async with self._publish_slots:
            t0 = time.perf_counter()
            await self.publisher(row)
        self.ctx.store.update_snapshot(row.id, published=True)
        log.info("snapshot=%s published in %.2fs", row.id, time.perf_counter() - t0)

    # ---- the repository: publish, resume after a crash, fetch back ------------------------------
    def attach_repository(self, repository: Any) -> None:
        """Publish every user snapshot to ``repository`` (an ``aenv.snapshots.SnapshotRepository``)
        and fetch from it what is not here. Call once at start-up, before serving."""
        from aenv.snapshots.publish import clean_fetch_leftovers

        repository.clean_scratch()
        clean_fetch_leftovers(self.ctx.settings.snapshots_dir)
        self.ctx.repository = repository
        self.publisher = self._publish_to_repository

    def resume_publishing(self) -> list[str]:
        """Publish again what a crash (or a failed upload) left unpublished; collect what a publish
        killed half-way left in the repository. Returns the snapshot IDs queued."""
        queued = []
        for row in self.ctx.store.list_snapshots():
            if row.state == "ready" and not row.internal and not row.published and Path(row.dir).is_dir():
                self.publish(row)
                queued.append(row.id)
        if queued:
            log.info("re-publishing %d snapshot(s) left unpublished: %s", len(queued), ", ".join(queued[:10]))
        repo = self.ctx.repository
        if repo is not None:

            async def gc() -> None:
                try:
                    freed = await repo.collect_garbage(GC_GRACE_S)
                    if freed:
                        log.info("snapshot repository: freed %d unreferenced layer(s)", freed)
                except Exception as exc:
                    log.warning("snapshot repository garbage collection failed: %s", exc)

            task = asyncio.create_task(gc(), name="aenv-repository-gc")
            self._publish_tasks.add(task)
            task.add_done_callback(self._publish_tasks.discard)
        return queued

    async def aclose(self) -> None:
        """Stop background publishing (a restart resumes it)."""
        tasks = list(self._publish_tasks)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t

    async def _publish_to_repository(self, row: SnapshotRow) -> None:
        from aenv.snapshots.publish import publish_snapshot

        repo = self.ctx.repository
        base = self.ctx.store.get_template(row.template_id)
        own = self.ctx.store.get_template(row.id)
        meta = {
            "template_alias": base.alias if base else None,
            "template_source": base.source if base else None,
            "sandbox_id": row.sandbox_id,
            "owner": row.owner,  # the team whose snapshot it is: private to it on every node that fetches it
            "size_bytes": row.size_bytes,
            "cpu_count": own.cpu_count if own and own.id == row.id else None,
            "memory_mb": own.memory_mb if own and own.id == row.id else None,
        }
        await publish_snapshot(
            repo, snapshot_id=row.id, directory=Path(row.dir), mode=row.mode, runtime=row.runtime,
            template_id=row.template_id, result=row.result, parent=row.parent_id, name=row.name,
            created_at=row.created_at, meta=meta,
        )
        if self.ctx.store.get_snapshot(row.id) is None:  # deleted while uploading: take it back out
            with contextlib.suppress(FileNotFoundError):
                await repo.delete(row.id)

    async def resolve_template(self, name: str) -> TemplateRow:
        """The template ``Sandbox.create(name)`` starts from, fetching a snapshot from the repository
        when it is not here: an unknown name that is a snapshot ID in the repository, or a snapshot
        template whose directory is gone (see the module docstring)."""
        try:
            tpl = self.ctx.templates.resolve(name)
        except TemplateNotFound:
            if self.template_fetch is not None and await self.template_fetch(name):
                return self.ctx.templates.resolve(name)  # a built template from the shared store
            if await self.fetch(name) is None:
                raise
            return self.ctx.templates.resolve(name)
        if tpl.config.get("built") and self.template_recheck is not None and await self.template_recheck(tpl):
            tpl = self.ctx.templates.resolve(name)  # a rebuild on another node: its build fetched first
        if tpl.kind is TemplateKind.SNAPSHOT and self.ctx.repository is not None:
            row = self.ctx.store.get_snapshot(tpl.id)
            if row is not None and row.id == tpl.id and row.state == "ready" and not Path(row.dir).is_dir():
                await self.fetch(row.id)
        return tpl

    async def fetch(self, snapshot_id: str) -> SnapshotRow | None:
        """Make snapshot ``snapshot_id`` available here from the repository: download and verify its
        layers (sha256 + size), place them under ``<state>/snapshots/<id>`` (atomically: complete or
        absent), record the row (``published``) and its template. Returns the row; None if the
        repository does not have it (or there is no repository). A present snapshot is returned as is."""
        repo = self.ctx.repository
        if repo is None or not is_valid_id(snapshot_id):
            return None
        if self._fetch_lock is None:
            self._fetch_lock = asyncio.Lock()
        async with self._fetch_lock:  # fetches are rare: one at a time, and never twice the same
            return await self._fetch_locked(repo, snapshot_id)

    async def _fetch_locked(self, repo: Any, snapshot_id: str) -> SnapshotRow | None:
        from aenv.snapshots.manifest import ManifestError
        from aenv.snapshots.publish import materialize

        row = self.ctx.store.get_snapshot(snapshot_id)
        if row is not None and row.id != snapshot_id:
            row = None  # a snapshot *named* like this ID: not the one asked for
        if row is not None and (row.state != "ready" or Path(row.dir).is_dir()):
            return row if row.state == "ready" else None
        try:
            manifest = await repo.find_manifest(snapshot_id)
        except (ManifestError, ValueError) as exc:
            raise RuntimeFailure(f"snapshot '{snapshot_id}' in the repository is unreadable: {exc}") from None
        except Exception as exc:
            raise RuntimeFailure(f"snapshot repository unreachable looking up '{snapshot_id}': {short_error(exc)}") from None
        if manifest is None:
            return None
        runtime = self.ctx.runtime.name
        if manifest.runtime != runtime:
            raise StateError(
                f"snapshot '{snapshot_id}' was taken on the {manifest.runtime} runtime; this server runs {runtime}",
                snapshot_id=snapshot_id,
            )
        template = self._image_template_for(snapshot_id, manifest.template_id, manifest.meta.get("template_alias"))
        dest = Path(row.dir) if row is not None else self.ctx.settings.snapshots_dir / snapshot_id
        t0 = time.perf_counter()
        try:
            result = await materialize(repo, manifest, dest, [str(p) for p in (template.lowers or [template.rootfs])])
        except ManifestError as exc:
            raise RuntimeFailure(f"snapshot '{snapshot_id}' in the repository is unusable: {exc}") from None
        except Exception as exc:
            raise RuntimeFailure(f"fetching snapshot '{snapshot_id}' from the repository failed: {short_error(exc)}") from None
        size = await asyncio.to_thread(disk_usage, dest)
        if row is None:
            row = SnapshotRow(
                id=snapshot_id, name=manifest.name, sandbox_id=manifest.meta.get("sandbox_id"),
                parent_id=manifest.parent, template_id=template.id, runtime=runtime, mode=manifest.mode,
                state="ready", internal=False, created_at=manifest.created_at or now(), dir=str(dest),
                result=result, published=True, size_bytes=size, owner=str(manifest.meta.get("owner") or ""),
            )
            self.ctx.store.put_snapshot(row)
        else:
            row.result, row.published, row.size_bytes = result, True, size
            self.ctx.store.update_snapshot(snapshot_id, result=result, published=True, size_bytes=size)
        existing = self.ctx.store.get_template(snapshot_id)
        if existing is None or existing.id != snapshot_id:
            alias = manifest.name if manifest.name and self.ctx.store.get_template(manifest.name) is None else None
            meta = manifest.meta
            self.ctx.templates.register(
                alias=alias, kind=TemplateKind.SNAPSHOT, rootfs=Path(template.rootfs), lowers=[Path(p) for p in template.lowers],
                config={**template.config, "snapshot": snapshot_id}, source=f"snapshot {snapshot_id} (repository)",
                template_id=snapshot_id, cpu_count=meta.get("cpu_count") if isinstance(meta.get("cpu_count"), int) else None,
                memory_mb=meta.get("memory_mb") if isinstance(meta.get("memory_mb"), int) else None, size_bytes=size,
                owner=str(meta.get("owner") or ""),
            )
        log.info("snapshot=%s fetched from the repository in %.2fs (%d layers, %d bytes)", snapshot_id,
                 time.perf_counter() - t0, len(manifest.layers), sum(layer.size for layer in manifest.layers))
        return row

    def _image_template_for(self, snapshot_id: str, template_id: str, alias: Any) -> TemplateRow:
        tpl = image_template(self.ctx, template_id, alias)
        if tpl is None:
            raise StateError(
                f"snapshot '{snapshot_id}' runs on template '{alias or template_id}', which this server does not "
                "have: pull or build it first", snapshot_id=snapshot_id,
            )
        return tpl


def image_template(ctx: Context, template_id: str, alias: Any) -> TemplateRow | None:
    """This node's image template a fetched snapshot or built template runs on: by ID, else by alias
    (``base`` is the same everywhere, its ID need not be); None when it has none (a snapshot template
    does not count: layers stack on an image)."""
    tpl = ctx.store.get_template(template_id)
    if tpl is None or tpl.id != template_id:
        tpl = ctx.store.get_template(alias) if isinstance(alias, str) and alias else None
        if tpl is not None and tpl.alias != alias:
            tpl = None
    return None if tpl is None or tpl.kind is TemplateKind.SNAPSHOT else tpl

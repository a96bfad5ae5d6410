"""Built templates shared through the snapshot store: a build runs on one node, any node runs it.

Only with a store the nodes share (``snapshot_store`` set explicitly; the default, a directory in each
node's own state dir, is not shared, and nothing here runs then) and on the ns runtime (``RUNTIMES``:
a vm template's snapshot is layered on each node's own ``base`` disk build; vm nodes keep the replay):

- **publish** (the building node, before the build says ``ready``): the build's final snapshot is
  published like any snapshot (content-addressed layers: its upper dir and process image, with the
  build steps' upper dirs under it), then a template manifest keyed by
  the template ID names it, with the template's rows (IDs, aliases and tags, config, resources, owner)
  and the build ID (``aenv.snapshots.templates``);
- **lazily** (with ``lazy_images``, on by default in cluster mode): the building node also flattens the
  template's whole tree (its layers over the image's) into the chunked ext4 of ``aenv.images.lazy``
  and puts it in the same store (``lazy/<hex>/``, named in the manifest's ``lazy``);
- **fetch** (any node, on first use): a create of a name or ID this node does not have looks it up in
  the store. Where the manifest names a lazy artifact and aenv-lazyd runs here, the artifact is mounted
  (a hidden image template ``lazy-<hex>`` under the rows) and only the chunks sandboxes read are ever
  fetched; only the snapshot's process image (ns full mode) is downloaded whole. Otherwise (no artifact,
  no FUSE: the log says which) the layers are downloaded whole and checked. Either way the snapshot is
  recorded (internal, published) and the rows registered under the same IDs, aliases and tags; so a
  node down during the build, or added after it, gets the template when a sandbox of it first lands there;
- **recheck** (a node holding it, at a create, at most every ``template_recheck_s``): where the manifest
  says the created row names another build (a rebuild ran on another node), that build is fetched first;
- **tags**: a tag added or removed here (a gateway sends it to every node holding the template) is written
  to the manifest's rows (``sync_rows``), so a node fetching the template later has it too;
- **delete**: a template deleted here is taken out of the store too (its default row or ID: the whole
  template; another tag's row: that row), and a delete of one this node never fetched still removes it
  from the store. A gateway sends a delete to every node (``gateway/control.py``).

The image template at the root of the build (``base``, or a pulled image's) is not in the store's
layers: a node fetching them whole must have it by ID or alias, as for any fetched snapshot (``sync.py``);
the lazy artifact holds it (a lazy node needs nothing but the artifact).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aenv.config import Settings
from aenv.core.context import Context
from aenv.core.snapshots import SnapshotFlows
from aenv.core.sync import disk_usage, image_template, short_error
from aenv.core.template_flows import TemplateFlows
from aenv.core.templates import family_of
from aenv.errors import AenvError, RuntimeFailure, StateError, TemplateNotFound
from aenv.kinds import TemplateKind
from aenv.store.sqlite import SnapshotRow, TemplateRow, now

log = logging.getLogger("aenv.core")

# vm: a built template's snapshot is layered on the disk of the node's own ``base`` build (mkfs picks new
# UUIDs per node), so it would not restore elsewhere; until that build ships with it, vm nodes replay.
RUNTIMES = ("ns",)
HOST_KEYS = ("lazy_file",)  # config keys naming this host's paths: taken from the fetching node's base


def shares_templates(settings: Settings, runtime: str) -> bool:
    """Built templates go through a store the nodes share: one is set explicitly (the default is in
    each node's own state dir) and the runtime's snapshots restore on another node's base (``RUNTIMES``)."""
    return bool(settings.snapshot_store and settings.snapshot_store.strip()) and runtime in RUNTIMES


def row_entry(row: TemplateRow) -> dict[str, Any]:
    """What a template manifest keeps of one catalog row."""
    config = {k: v for k, v in row.config.items() if k not in HOST_KEYS}
    return {"id": row.id, "alias": row.alias, "config": config, "cpu_count": row.cpu_count,
            "memory_mb": row.memory_mb, "source": row.source, "public": row.public}  # fmt: skip


def base_entry(row: TemplateRow | None, template_id: str) -> dict[str, Any]:
    if row is None:
        return {"id": template_id}
    return {"id": row.id, "alias": row.alias, "source": row.source, "manifest_digest": row.config.get("manifest_digest")}


class TemplateShare:
    def __init__(self, ctx: Context, snapshots: SnapshotFlows, flows: TemplateFlows) -> None:
        self.ctx = ctx
        self.snapshots = snapshots
        self.flows = flows
        self._lock = asyncio.Lock()  # fetches: one at a time, and never twice the same
        self._checked: dict[str, float] = {}  # family -> when the store was last asked about it (monotonic)

    @property
    def shared(self) -> bool:
        """A store the nodes share is configured (explicitly: the default is this node's own)."""
        return shares_templates(self.ctx.settings, self.ctx.runtime.name) and self.ctx.repository is not None

    def rows_of(self, family: str) -> list[TemplateRow]:
        return [r for r in self.ctx.templates.list_templates()
                if r.config.get("built") and not r.config.get("hidden") and family_of(r) == family]  # fmt: skip

    # ---- publish --------------------------------------------------------------------------------
    async def publish(self, family: str, build_id: str, snapshot_id: str) -> bool:
        """Publish the template ``family`` (built here, its rows registered) and its snapshot. False
        when there is no shared store (nothing done)."""
        if not self.shared:
            return False
        from aenv.snapshots.publish import publish_snapshot
        from aenv.snapshots.templates import TemplateManifest, get_template, put_template

        repo = self.ctx.repository
        snap = self.ctx.store.get_snapshot(snapshot_id)
        rows = self.rows_of(family)
        if snap is None or not rows:
            raise StateError(f"template '{family}': nothing to publish (snapshot {snapshot_id} or its rows are gone)")
        base = self.ctx.store.get_template(snap.template_id)
        t0 = time.perf_counter()
        await publish_snapshot(
            repo, snapshot_id=snap.id, directory=Path(snap.dir), mode=snap.mode, runtime=snap.runtime,
            template_id=snap.template_id, result=snap.result, created_at=snap.created_at,
            meta={"template_alias": base.alias if base else None, "template_source": base.source if base else None,
                  "owner": snap.owner, "built_template": family},
        )  # fmt: skip
        old = await get_template(repo, family)
        manifest = TemplateManifest(
            template_id=family, build_id=build_id, snapshot_id=snap.id, runtime=self.ctx.runtime.name,
            owner=rows[0].owner, base=base_entry(base, snap.template_id), rows=[row_entry(r) for r in rows],
            created_at=now(), lazy=await self._publish_lazy(family, snap),
        )  # fmt: skip
        await put_template(repo, manifest)
        if old is not None and old.snapshot_id != snap.id:  # a rebuild: the previous build's snapshot goes
            try:
                await repo.delete(old.snapshot_id)
            except FileNotFoundError:
                pass
            await self._delete_lazy(old.lazy)
        log.info("template=%s build=%s published to the store in %.2fs", family, build_id, time.perf_counter() - t0)
        return True

    def family_named(self, name: str) -> str | None:
        """The template ID behind ``name`` (a name, ``name:tag`` or an ID) where it is a built template here."""
        try:
            row = self.ctx.templates.resolve(name)
        except TemplateNotFound:
            return None
        return family_of(row) if row.config.get("built") else None

    async def sync_rows(self, family: str | None) -> None:
        """After its tags changed here: the manifest in the store lists the template's rows as this node has
        them, so a node that fetches it later knows the new tags (or no longer the removed ones). Only a
        node holding the build the manifest names writes; a failure is logged, the tags stay changed here
        (a later tag change or rebuild writes them again)."""
        if not self.shared or family is None:
            return
        from dataclasses import replace

        from aenv.snapshots.templates import get_template, put_template

        rows = self.rows_of(family)
        try:
            manifest = await get_template(self.ctx.repository, family)
            if manifest is None or not any(r.config.get("build_id") == manifest.build_id for r in rows):
                return  # never published, or this node holds another build than the store's
            entries = [row_entry(r) for r in rows]
            if sorted(entries, key=lambda e: str(e["id"])) != sorted(manifest.rows, key=lambda e: str(e["id"])):
                await put_template(self.ctx.repository, replace(manifest, rows=entries))
                log.info("template=%s its %d tags written to the store", family, len(entries))
        except Exception as exc:
            log.warning("template=%s tags not written to the store: %s", family, short_error(exc))

    def _lazy_store(self) -> Any:
        from aenv.images.lazy.service import store_at

        url = self.ctx.settings.snapshot_store_url
        assert url is not None  # shared: a store is set
        return store_at(url, self.ctx.settings)

    async def _publish_lazy(self, family: str, snap: SnapshotRow) -> dict[str, Any]:
        """The template's flattened tree as a lazy artifact in the store ({} when lazy images are off
        or it failed: nodes then fetch the layers whole, as the log says)."""
        settings = self.ctx.settings
        if not (settings.lazy_images and settings.lazy_publish):
            return {}
        from aenv.snapshots.record import normalize

        record = normalize(snap.result)
        lowers = [str(Path(snap.dir) / "upper"), *record["stack"], *record["base_lowers"]]
        digest = lazy_digest(snap.id)
        t0 = time.perf_counter()
        try:
            art = await self.flows.builder.lazy.publish_tree(self._lazy_store(), digest, lowers)
        except Exception as exc:
            log.warning("template=%s: no lazy artifact (nodes fetch its layers whole): %s", family, short_error(exc))
            return {}
        log.info("template=%s lazy artifact published in %.2fs (%d chunks, %d bytes stored)", family,
                 time.perf_counter() - t0, len(art.index.chunks), art.index.stored_bytes)  # fmt: skip
        return {"digest": digest, "chunks": len(art.index.chunks), "stored": art.index.stored_bytes}

    async def _delete_lazy(self, lazy: dict[str, Any]) -> None:
        digest = lazy.get("digest")
        if not isinstance(digest, str):
            return
        from aenv.images.lazy.publish import delete_from_store

        try:
            await delete_from_store(self._lazy_store(), digest)
        except Exception as exc:
            log.warning("lazy artifact %s not deleted from the store: %s", digest, short_error(exc))

    # ---- recheck --------------------------------------------------------------------------------
    async def recheck(self, row: TemplateRow) -> bool:
        """Before a create of ``row`` (a built template this node holds): where the store's manifest says
        its tag now names another build (a rebuild, which ran on one node), fetch that build first, so
        every node starts the same one; True when it did. Asked at most every ``template_recheck_s`` per
        template; a store that cannot be read leaves the build held here in use (logged)."""
        if not self.shared or not row.config.get("built") or row.config.get("hidden"):
            return False
        family = family_of(row)
        at = time.monotonic()
        if at - self._checked.get(family, float("-inf")) < self.ctx.settings.template_recheck_s:
            return False
        self._checked[family] = at
        from aenv.snapshots.templates import get_template

        try:
            manifest = await get_template(self.ctx.repository, family)
        except Exception as exc:
            log.warning("template=%s: the store could not be asked for a newer build: %s", family, short_error(exc))
            return False
        entry = next((e for e in manifest.rows if e["id"] == row.id), None) if manifest is not None else None
        if manifest is None or entry is None or entry["config"].get("build_id") == row.config.get("build_id"):
            return False
        log.info("template=%s: the store names build %s where this node held %s: fetching it", family,
                 entry["config"].get("build_id"), row.config.get("build_id"))  # fmt: skip
        async with self._lock:
            return await self._fetch_locked(family)

    # ---- fetch ----------------------------------------------------------------------------------
    async def fetch(self, name: str) -> bool:
        """Make the template ``name`` (ID, alias, ``name:tag``) available here from the shared store.
        False when the store has no such template (or there is no shared store)."""
        if not self.shared:
            return False
        async with self._lock:
            try:
                self.ctx.templates.resolve(name)
                return True  # fetched while this one waited
            except TemplateNotFound:
                pass
            return await self._fetch_locked(name)

    async def _fetch_locked(self, name: str) -> bool:
        from aenv.snapshots.manifest import ManifestError
        from aenv.snapshots.publish import materialize
        from aenv.snapshots.templates import find_template

        repo = self.ctx.repository
        try:
            manifest = await find_template(repo, name)
        except (ManifestError, ValueError) as exc:
            raise RuntimeFailure(f"template '{name}' in the store is unreadable: {exc}") from None
        except Exception as exc:
            raise RuntimeFailure(f"the store is unreachable looking up template '{name}': {short_error(exc)}") from None
        if manifest is None:
            return False
        if manifest.runtime != self.ctx.runtime.name:
            raise StateError(f"template '{name}' was built on the {manifest.runtime} runtime; this node runs "
                             f"{self.ctx.runtime.name}", template=name)  # fmt: skip
        t0 = time.perf_counter()
        if await self._fetch_lazily(name, manifest):
            return True
        base = self._base_here(name, manifest.base)
        lowers = [str(p) for p in (base.lowers or [base.rootfs])]
        await self._fetch_snapshot(name, manifest, base,
                                   lambda snap_manifest, dest: materialize(repo, snap_manifest, dest, lowers))
        # no await from here on: the snapshot GC keeps an internal snapshot a template points at
        for entry in manifest.rows:
            self._register(entry, base, manifest.owner, manifest.snapshot_id)
        log.info("template=%s (%s) fetched from the store in %.2fs", manifest.template_id, name, time.perf_counter() - t0)
        return True

    async def _fetch_lazily(self, name: str, manifest: Any) -> bool:
        """The template registered here over its lazy artifact; False: fetch its layers whole."""
        t0 = time.perf_counter()
        lazy_base = await self._lazy_base(name, manifest)
        if lazy_base is None:
            return False
        from aenv.snapshots.publish import materialize_files_elsewhere

        root = str(lazy_base.rootfs)
        snap = await self._fetch_snapshot(
            manifest.template_id, manifest, lazy_base,
            lambda snap_manifest, dest: materialize_files_elsewhere(self.ctx.repository, snap_manifest, dest, root))
        for entry in manifest.rows:  # no await from here on: the snapshot GC keeps what a template points at
            self._register(entry, lazy_base, manifest.owner, snap.id)
        log.info("template=%s (%s) fetched lazily from the store in %.2fs: its files on demand",
                 manifest.template_id, name, time.perf_counter() - t0)  # fmt: skip
        return True

    async def _lazy_base(self, name: str, manifest: Any) -> TemplateRow | None:
        """The template's lazy artifact mounted here, as a hidden image template; None (the layers are
        fetched whole, the log says why) when the manifest names none or this node cannot read one."""
        digest = manifest.lazy.get("digest")
        lazy = self.flows.builder.lazy
        if not isinstance(digest, str):
            log.info("template=%s has no lazy artifact in the store: fetching its layers whole", manifest.template_id)
            return None
        if not lazy.available:
            log.info("template=%s: lazy images unavailable here (%s): fetching its layers whole",
                     manifest.template_id, lazy.reason)  # fmt: skip
            return None
        from aenv.images.lazy.publish import find_in_store
        from aenv.images.lazy.service import lazy_name

        base_id = f"lazy-{lazy_name(digest)[:24]}"
        try:
            art = await find_in_store(self._lazy_store(), digest)
            if art is None:
                raise StateError(f"its artifact {digest} is not in the store")
            root = await lazy.root_of(digest, art)
        except (AenvError, OSError, ValueError) as exc:
            log.warning("template=%s: lazy fetch unavailable (%s): fetching its layers whole", manifest.template_id,
                        short_error(exc))  # fmt: skip
            return None
        row = self.ctx.store.get_template(base_id)
        if row is not None and row.id == base_id:
            return row
        return self.ctx.templates.register(
            alias=None, kind=TemplateKind.IMAGE, rootfs=root, lowers=[root], template_id=base_id,
            config={"hidden": True, "lazy_digest": digest, "env": {}}, source=f"template {manifest.template_id} (lazy)",
            size_bytes=art.index.size,
        )  # fmt: skip

    async def _fetch_snapshot(self, name: str, manifest: Any, base: TemplateRow,
                              fill: Callable[[Any, Path], Awaitable[dict[str, Any]]]) -> SnapshotRow:
        """The template's snapshot recorded here over ``base`` (as it is, when already here), its layers
        downloaded into place by ``fill(snapshot manifest, dest)``: whole, or only the process image over a
        lazy root."""
        snap = self.ctx.store.get_snapshot(manifest.snapshot_id)
        if snap is not None and snap.id == manifest.snapshot_id and snap.state == "ready" and Path(snap.dir).is_dir():
            return snap
        snap_manifest = await self.ctx.repository.find_manifest(manifest.snapshot_id)
        if snap_manifest is None:
            raise RuntimeFailure(f"template '{name}': its snapshot {manifest.snapshot_id} is not in the store")
        dest = self.ctx.settings.snapshots_dir / manifest.snapshot_id
        try:
            result = await fill(snap_manifest, dest)
        except Exception as exc:
            raise RuntimeFailure(f"fetching template '{name}' from the store failed: {short_error(exc)}") from None
        snap = SnapshotRow(
            id=manifest.snapshot_id, template_id=base.id, runtime=snap_manifest.runtime, mode=snap_manifest.mode,
            state="ready", created_at=snap_manifest.created_at or now(), dir=str(dest), internal=True, result=result,
            published=True, size_bytes=await asyncio.to_thread(disk_usage, dest), owner=manifest.owner,
        )  # fmt: skip
        self.ctx.store.put_snapshot(snap)
        return snap

    def _base_here(self, name: str, base: dict[str, Any]) -> TemplateRow:
        row = image_template(self.ctx, str(base.get("id") or ""), base.get("alias"))
        if row is None:
            raise StateError(f"template '{name}' was built on '{base.get('alias') or base.get('source') or base.get('id')}',"
                             " which this node does not have: pull it here first", template=name)  # fmt: skip
        return row

    def _register(self, entry: dict[str, Any], base: TemplateRow, owner: str, snapshot_id: str) -> None:
        config = {**{k: base.config[k] for k in HOST_KEYS if k in base.config}, **entry["config"], "snapshot": snapshot_id}
        row = self.ctx.templates.register(
            alias=entry.get("alias"), kind=TemplateKind.SNAPSHOT, rootfs=Path(base.rootfs),
            lowers=[Path(p) for p in base.lowers], config=config, source=entry.get("source"),
            template_id=str(entry["id"]), cpu_count=entry.get("cpu_count"), memory_mb=entry.get("memory_mb"), owner=owner,
        )  # fmt: skip
        if entry.get("public"):
            self.ctx.store.set_template_public(row.id, True)

    # ---- delete ---------------------------------------------------------------------------------
    async def delete(self, name: str) -> None:
        """Delete template ``name`` here (refused while sandboxes use it) and, for a built template
        with a shared store, in the store too; a name only the store has is deleted there."""
        try:
            row = self.ctx.templates.resolve(name)
        except TemplateNotFound:
            if not await self._unpublish(name, None):
                raise
            return
        if row.kind is TemplateKind.SNAPSHOT and not row.config.get("built"):
            await self.snapshots.delete(row.id)
        elif row.kind is TemplateKind.SNAPSHOT:  # a built template: its snapshot goes when nothing needs it
            self.ctx.templates.delete(row.id, in_use=self.ctx.table.template_ids_in_use())
            await self.ctx.runtime.forget_template(row.id)
            self.snapshots.collect_garbage()
            await self._release_lazy_bases()
            await self._unpublish(family_of(row), row.id)
        else:
            await self.flows.delete(row)

    async def _release_lazy_bases(self) -> None:
        """Hidden lazy image templates no template or snapshot rests on any more: unmounted and gone."""
        rows = self.ctx.templates.list_templates()
        under = {s.template_id for s in self.ctx.store.list_snapshots()}
        roots = {str(r.rootfs) for r in rows if r.kind is TemplateKind.SNAPSHOT}
        for r in rows:
            digest = r.config.get("lazy_digest")
            if r.kind is TemplateKind.IMAGE and isinstance(digest, str) and r.id not in under and str(r.rootfs) not in roots:
                self.ctx.templates.delete(r.id, in_use=self.ctx.table.template_ids_in_use())
                await self.ctx.runtime.forget_template(r.id)
                await self.flows.builder.lazy.release_root(digest)

    async def _unpublish(self, name: str, row_id: str | None) -> bool:
        """Take template ``name`` out of the store (``row_id``: only that tag's row, unless it is the
        template's own). False when the store does not have it."""
        if not self.shared:
            return False
        from aenv.snapshots.templates import delete_template, find_template, put_template

        repo = self.ctx.repository
        try:
            manifest = await find_template(repo, name)
            if manifest is None:
                return False
            target = row_id or next((str(r["id"]) for r in manifest.rows if name in (r["id"], r.get("alias"))), None)
            rest = manifest.without_row(target) if target not in (None, manifest.template_id) else None
            if rest is not None and rest.rows:
                await put_template(repo, rest)
            else:
                await delete_template(repo, manifest)
                await self._delete_lazy(manifest.lazy)
        except Exception as exc:
            raise RuntimeFailure(f"deleting template '{name}' from the store failed: {short_error(exc)}") from None
        log.info("template=%s deleted from the store%s", manifest.template_id, f" (row {row_id})" if rest else "")
        return True


def lazy_digest(snapshot_id: str) -> str:
    """The name of a built template's lazy artifact: one per build (its final snapshot)."""
    return "sha256:" + hashlib.sha256(f"aenv-template:{snapshot_id}".encode()).hexdigest()

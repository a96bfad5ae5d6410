"""Built templates shared through the snapshot store: a build runs on one node, any node runs it.

Only with a store the nodes share (``snapshot_store`` set explicitly; the default, a directory in each
node's own state dir, is not shared, and nothing here runs then) and on the ns runtime (``RUNTIMES``:
a vm template's snapshot is layered on each node's own ``base`` disk build; vm nodes keep the replay):

- **publish** (the building node, before the build says ``ready``): the build's final snapshot is
  published like any snapshot (content-addressed layers: its upper dir and process image, with the
  build steps' upper dirs under it), then a template manifest keyed by
  the template ID names it, with the template's rows (IDs, aliases and tags, config, resources, owner)
  and the build ID (``aenv.snapshots.templates``);
- **fetch** (any node, on first use): a create of a name or ID this node does not have looks it up in
  the store, downloads and checks the layers (whole layers, not lazily chunked), records the snapshot
  (internal, published) and registers the rows under the same IDs, aliases and tags; so a node down
  during the build, or added after it, gets the template when a sandbox of it first lands there;
- **delete**: a template deleted here is taken out of the store too (its default row or ID: the whole
  template; another tag's row: that row), and a delete of one this node never fetched still removes it
  from the store. A gateway sends a delete to every node (``gateway/control.py``).

The image template at the root of the build (``base``, or a pulled image's) is not in the store: the
fetching node must have it by ID or alias, as for any fetched snapshot (``sync.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from aenv.config import Settings
from aenv.core.context import Context
from aenv.core.snapshots import SnapshotFlows
from aenv.core.sync import disk_usage, image_template, short_error
from aenv.core.template_flows import TemplateFlows
from aenv.core.templates import family_of
from aenv.errors import RuntimeFailure, StateError, TemplateNotFound
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
        self._lock: asyncio.Lock | None = None

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
            created_at=now(),
        )  # fmt: skip
        await put_template(repo, manifest)
        if old is not None and old.snapshot_id != snap.id:  # a rebuild: the previous build's snapshot goes
            try:
                await repo.delete(old.snapshot_id)
            except FileNotFoundError:
                pass
        log.info("template=%s build=%s published to the store in %.2fs", family, build_id, time.perf_counter() - t0)
        return True

    # ---- fetch ----------------------------------------------------------------------------------
    async def fetch(self, name: str) -> bool:
        """Make the template ``name`` (ID, alias, ``name:tag``) available here from the shared store.
        False when the store has no such template (or there is no shared store)."""
        if not self.shared:
            return False
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # one at a time, and never twice the same
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
        base = self._base_here(name, manifest.base)
        t0 = time.perf_counter()
        snap = self.ctx.store.get_snapshot(manifest.snapshot_id)
        if snap is None or snap.id != manifest.snapshot_id or snap.state != "ready" or not Path(snap.dir).is_dir():
            snap_manifest = await repo.find_manifest(manifest.snapshot_id)
            if snap_manifest is None:
                raise RuntimeFailure(f"template '{name}': its snapshot {manifest.snapshot_id} is not in the store")
            dest = self.ctx.settings.snapshots_dir / manifest.snapshot_id
            try:
                result = await materialize(repo, snap_manifest, dest, [str(p) for p in (base.lowers or [base.rootfs])])
            except Exception as exc:
                raise RuntimeFailure(f"fetching template '{name}' from the store failed: {short_error(exc)}") from None
            snap = SnapshotRow(
                id=manifest.snapshot_id, template_id=base.id, runtime=snap_manifest.runtime, mode=snap_manifest.mode,
                state="ready", created_at=snap_manifest.created_at or now(), dir=str(dest), internal=True,
                result=result, published=True, size_bytes=await asyncio.to_thread(disk_usage, dest),
                owner=manifest.owner,
            )  # fmt: skip
            self.ctx.store.put_snapshot(snap)
        # no await from here on: the snapshot GC keeps an internal snapshot a template points at
        for entry in manifest.rows:
            self._register(entry, base, manifest.owner, manifest.snapshot_id)
        log.info("template=%s (%s) fetched from the store in %.2fs", manifest.template_id, name, time.perf_counter() - t0)
        return True

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
            await self._unpublish(family_of(row), row.id)
        else:
            await self.flows.delete(row)

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
        except Exception as exc:
            raise RuntimeFailure(f"deleting template '{name}' from the store failed: {short_error(exc)}") from None
        log.info("template=%s deleted from the store%s", manifest.template_id, f" (row {row_id})" if rest else "")
        return True

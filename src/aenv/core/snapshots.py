"""Snapshot, fork and rollback flows (the orchestrator's checkpoint tree).

* A snapshot is a directory under ``<state>/snapshots/<id>`` written by the runtime, a row in the store
  (written first, state ``creating``), and a template of kind ``snapshot`` so ``Sandbox.create(<id>)``
  works. Publishing to the snapshot repository (content-addressed layers) runs in the background.
* Repository (``attach_repository``): every user snapshot is published in the background and its row
  marked ``published``; a restart re-publishes what a crash left unpublished (the manifest is written
  last, so the repository never shows half a snapshot). **How a server learns about snapshots it did
  not take** (another state dir or machine sharing the bucket, or a local directory lost): lazily, by
  ID. ``Sandbox.create(template=<snapshot id>)`` on a name no local template has looks
  ``manifests/<id>.json`` up in the repository and, if found, downloads and verifies its layers and
  registers it as a local snapshot + template (``fetch``); a known snapshot whose directory is gone is
  fetched again the same way before a create or a rollback. Nothing lists the bucket: names are per
  server, IDs are global. The image template under a snapshot is not in the repository: the fetching
  server must have it (same ID, else same alias; ``base`` everywhere). Deleting a snapshot deletes it
  from the repository as well, on whichever server does it.
* Lineage: every sandbox has a ``lineage_head`` (the snapshot its state descends from). A new snapshot's
  parent is that head; rollback accepts any snapshot on the chain from the head to the root.
* Dependencies: a sandbox started from a snapshot may need its files while alive (ns overlay lowers, vm
  RAM files): ``depends_on`` lists them; such snapshots cannot be deleted until nothing depends on them,
  and internal fork snapshots are collected as soon as nothing does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aenv.core.ids import is_valid_id, new_id, new_token
from aenv.core.models import SandboxState, require_state
from aenv.errors import (
    AenvError,
    CapacityError,
    Conflict,
    InvalidRequest,
    RuntimeFailure,
    SnapshotNotFound,
    StateError,
    TemplateNotFound,
)
from aenv.faults import fault_point
from aenv.runtime.base import UNFINISHED_MARKER, SnapshotCapable, SnapshotResult
from aenv.store.sqlite import SnapshotRow, TemplateRow, now

if TYPE_CHECKING:
    from aenv.core.orchestrator import LiveSandbox, Orchestrator

log = logging.getLogger("aenv.core")

MAX_FORK = 64
MODES = ("full", "filesystem")
PUBLISH_CONCURRENCY = 1  # packing is CPU-bound (tar + zstd -T0): one at a time leaves room for sandboxes
PUBLISH_RETRY_DELAYS = (5.0, 30.0, 120.0)  # a store that is briefly away does not wait for a restart
GC_GRACE_S = 6 * 3600.0  # unreferenced layers younger than this may belong to a publish in progress


def result_of(row: SnapshotRow) -> SnapshotResult:
    r = row.result
    return SnapshotResult(
        mode=row.mode, layers=tuple(r.get("layers", ())), parent_snapshot=row.parent_id, data=dict(r.get("data", {}))
    )


class SnapshotFlows:
    def __init__(self, orch: Orchestrator) -> None:
        self.orch = orch
        self.store = orch.store
        self._publish_tasks: set[asyncio.Task[None]] = set()
        self.publisher: Any = None  # optional: async callable(SnapshotRow) that uploads to the repository
        self._publish_slots: asyncio.Semaphore | None = None
        self._fetch_lock: asyncio.Lock | None = None
        self._settling: dict[str, asyncio.Task[None]] = {}  # snapshot ID -> waits for its files

    @property
    def runtime(self) -> SnapshotCapable:
        rt = self.orch.runtime
        if not isinstance(rt, SnapshotCapable):
            raise StateError(f"the {rt.name} runtime does not support snapshots")
        return rt

    # ---- queries --------------------------------------------------------------------------------
    def get(self, id_or_name: str) -> SnapshotRow:
        row = self.store.get_snapshot(id_or_name)
        if row is None or row.state != "ready":
            raise SnapshotNotFound(id_or_name)
        return row

    def list_snapshots(
        self, sandbox_id: str | None = None, name: str | None = None, include_internal: bool = False
    ) -> list[SnapshotRow]:
        return [
            r
            for r in self.store.list_snapshots()
            if r.state == "ready"
            and (include_internal or not r.internal)
            and (sandbox_id is None or r.sandbox_id == sandbox_id)
            and (name is None or r.name == name)
        ]

    def lineage(self, snapshot_id: str | None) -> list[SnapshotRow]:
        """The chain from a snapshot up to the root, newest first."""
        out: list[SnapshotRow] = []
        seen: set[str] = set()
        while snapshot_id and snapshot_id not in seen:
            seen.add(snapshot_id)
            row = self.store.get_snapshot(snapshot_id)
            if row is None:
                break
            out.append(row)
            snapshot_id = row.parent_id
        return out

    def children(self, snapshot_id: str) -> list[str]:
        return [r.id for r in self.store.list_snapshots() if r.parent_id == snapshot_id and r.state == "ready"]

    # ---- snapshot -------------------------------------------------------------------------------
    async def create(self, sandbox_id: str, name: str | None, mode: str) -> SnapshotRow:
        if mode not in MODES:
            raise InvalidRequest(f"unknown snapshot mode '{mode}': use full or filesystem")
        rt = self.runtime
        sbx = self.orch.get(sandbox_id)
        async with sbx.lock:
            require_state(sbx.id, sbx.state, SandboxState.RUNNING, SandboxState.PAUSED, action="snapshot")
            return await self._snapshot_locked(rt, sbx, name, mode, internal=False)

    async def _snapshot_locked(
        self, rt: SnapshotCapable, sbx: LiveSandbox, name: str | None, mode: str, *, internal: bool
    ) -> SnapshotRow:
        snap_id = new_id()
        directory = self.orch.settings.snapshots_dir / snap_id
        row = SnapshotRow(
            id=snap_id,
            name=name,
            sandbox_id=sbx.id,
            parent_id=sbx.row.lineage_head,
            template_id=self._base_template(sbx.row.template_id),
            runtime=self.orch.runtime.name,
            mode=mode,
            state="creating",
            internal=internal,
            created_at=now(),
            dir=str(directory),
        )
        self.store.put_snapshot(row)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fault_point("snapshot.stored")
            result = await rt.snapshot(sbx.id, directory, mode)
        except BaseException:
            self.store.delete_snapshot(snap_id)
            shutil.rmtree(directory, ignore_errors=True)
            raise
        fault_point("snapshot.done")
        if mode == "full" and result.mode != "full":
            # Never silently less than asked.
            self.store.delete_snapshot(snap_id)
            shutil.rmtree(directory, ignore_errors=True)
            raise StateError(
                f"the {self.orch.runtime.name} runtime can only take filesystem snapshots here "
                "(process memory needs CRIU >= 4.2 or the vm runtime); ask for mode=filesystem"
            )
        row.mode = result.mode
        row.state = "ready"
        row.result = {"layers": list(result.layers), "data": result.data}
        row.size_bytes = _du(directory)
        self.store.update_snapshot(snap_id, mode=row.mode, state=row.state, result=row.result, size_bytes=row.size_bytes)
        sbx.row.lineage_head = snap_id
        self.store.update_sandbox(sbx.id, lineage_head=snap_id)
        if not internal:
            self._register_template(row, sbx)
        if result.pending is not None:
            self._settle_later(row, result.pending, publish=not internal)
        elif not internal:
            self._publish(row)
        log.info("sandbox=%s snapshot=%s mode=%s parent=%s", sbx.id, snap_id, row.mode, row.parent_id)
        return row

    def _settle_later(self, row: SnapshotRow, pending: asyncio.Future[None], *, publish: bool) -> None:
        """The runtime returned before the snapshot's files were all written (the vm runtime writes
        RAM layer and disk while the sandbox runs on). When they are: record the final size and
        result, then publish. If they cannot be: the snapshot is deleted, loudly."""

        async def run() -> None:
            try:
                await pending
            except Exception as exc:
                log.error("snapshot=%s: its files could not be written (%s); deleting it", row.id, _short(exc))
                self._discard(row)
                return
            if self.store.get_snapshot(row.id) is None:
                return  # deleted meanwhile
            row.size_bytes = _du(Path(row.dir))
            # row.result holds the runtime's data dict, which it completed while writing the files
            self.store.update_snapshot(row.id, result=row.result, size_bytes=row.size_bytes)
            if publish:
                self._publish(row)

        task = asyncio.create_task(run(), name=f"aenv-snapshot-settle-{row.id}")
        self._settling[row.id] = task
        task.add_done_callback(lambda _: self._settling.pop(row.id, None))

    def is_writing(self, snapshot_id: str) -> bool:
        """The runtime is still writing this snapshot's files (see :meth:`_settle_later`)."""
        return snapshot_id in self._settling

    async def _settled(self, snapshot_id: str, timeout: float = 60.0) -> None:
        """Until the snapshot's files are written (or given up on: it is then discarded at the next
        start, see :meth:`discard_unfinished`)."""
        task = self._settling.get(snapshot_id)
        if task is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(task), timeout)

    def _discard(self, row: SnapshotRow) -> None:
        """Forget a snapshot that never got complete files; its sandbox's lineage steps back."""
        self.store.delete_template(row.id)
        self.store.delete_snapshot(row.id)
        shutil.rmtree(row.dir, ignore_errors=True)
        live = self.orch._live.get(row.sandbox_id or "")
        if live is not None and live.row.lineage_head == row.id:
            live.row.lineage_head = row.parent_id
            self.store.update_sandbox(live.id, lineage_head=row.parent_id)

    def discard_unfinished(self) -> list[str]:
        """At start-up: snapshots whose files a stopped server was still writing are incomplete
        (the runtime marks them with UNFINISHED_MARKER until done); delete them."""
        out = []
        for row in self.store.list_snapshots():
            if (Path(row.dir) / UNFINISHED_MARKER).exists():
                log.warning("snapshot=%s was still being written when the server stopped; deleting it", row.id)
                self._discard(row)
                out.append(row.id)
        return out

    def _register_template(self, row: SnapshotRow, sbx: LiveSandbox) -> None:
        """Make the snapshot startable by ID or name: it carries its image template's rootfs and config."""
        base = self.store.get_template(row.template_id)
        self.orch.templates.register(
            alias=row.name,
            kind="snapshot",
            rootfs=_path(base.rootfs) if base else _path(row.dir),
            lowers=[_path(p) for p in base.lowers] if base else [],
            config={**(base.config if base else {}), "snapshot": row.id},
            source=f"snapshot of {sbx.id}",
            template_id=row.id,
            cpu_count=sbx.row.cpu_count,
            memory_mb=sbx.row.memory_mb,
            size_bytes=row.size_bytes,
        )

    def _base_template(self, template_id: str) -> str:
        """Snapshots remember the image template at the root of their chain."""
        tpl = self.store.get_template(template_id)
        if tpl is not None and tpl.kind == "snapshot":
            snap = self.store.get_snapshot(tpl.id)
            if snap is not None:
                return snap.template_id
        return template_id

    def _publish(self, row: SnapshotRow) -> None:
        if self.publisher is None:
            return
        if self._publish_slots is None:
            self._publish_slots = asyncio.Semaphore(PUBLISH_CONCURRENCY)
        slots = self._publish_slots

        async def run() -> None:
            for attempt, delay in enumerate((*PUBLISH_RETRY_DELAYS, None)):
                try:
                    async with slots:
                        if self.store.get_snapshot(row.id) is None:
                            return  # deleted while it waited
                        t0 = time.perf_counter()
                        await self.publisher(row)
                    self.store.update_snapshot(row.id, published=True)
                    log.info("snapshot=%s published in %.2fs", row.id, time.perf_counter() - t0)
                    return
                except Exception as exc:
                    if self.store.get_snapshot(row.id) is None:
                        log.info("snapshot=%s deleted while it was being published", row.id)
                        return
                    final = delay is None or isinstance(exc, FileNotFoundError)
                    log.warning("snapshot=%s publish to the repository failed (attempt %d; %s): %s", row.id,
                                attempt + 1, "retried at the next start" if final else f"retry in {delay:g}s",
                                _short(exc), exc_info=log.isEnabledFor(logging.DEBUG))
                    if final or delay is None:
                        return
                await asyncio.sleep(delay)

        task = asyncio.create_task(run(), name=f"aenv-publish-{row.id}")
        self._publish_tasks.add(task)
        task.add_done_callback(self._publish_tasks.discard)

    # ---- the repository: publish, resume after a crash, fetch back ------------------------------
    def attach_repository(self, repository: Any) -> None:
        """Publish every user snapshot to ``repository`` (an ``aenv.snapshots.SnapshotRepository``)
        and fetch from it what is not here. Call once at start-up, before serving."""
        from aenv.snapshots.publish import clean_fetch_leftovers

        repository.clean_scratch()
        clean_fetch_leftovers(self.orch.settings.snapshots_dir)
        self.orch.repository = repository
        self.publisher = self._publish_to_repository

    def resume_publishing(self) -> list[str]:
        """Publish again what a crash (or a failed upload) left unpublished; collect what a publish
        killed half-way left in the repository. Returns the snapshot IDs queued."""
        queued = []
        for row in self.store.list_snapshots():
            if row.state == "ready" and not row.internal and not row.published and Path(row.dir).is_dir():
                self._publish(row)
                queued.append(row.id)
        if queued:
            log.info("re-publishing %d snapshot(s) left unpublished: %s", len(queued), ", ".join(queued[:10]))
        repo = self.orch.repository
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
        """Let snapshots being written settle, stop background publishing (a restart resumes it)."""
        for snapshot_id in list(self._settling):
            await self._settled(snapshot_id)
        tasks = list(self._publish_tasks)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t

    async def _publish_to_repository(self, row: SnapshotRow) -> None:
        from aenv.snapshots.publish import publish_snapshot

        repo = self.orch.repository
        base = self.store.get_template(row.template_id)
        own = self.store.get_template(row.id)
        meta = {
            "template_alias": base.alias if base else None,
            "template_source": base.source if base else None,
            "sandbox_id": row.sandbox_id,
            "size_bytes": row.size_bytes,
            "cpu_count": own.cpu_count if own and own.id == row.id else None,
            "memory_mb": own.memory_mb if own and own.id == row.id else None,
        }
        await publish_snapshot(
            repo, snapshot_id=row.id, directory=Path(row.dir), mode=row.mode, runtime=row.runtime,
            template_id=row.template_id, result=row.result, parent=row.parent_id, name=row.name,
            created_at=row.created_at, meta=meta,
        )
        if self.store.get_snapshot(row.id) is None:  # deleted while uploading: take it back out
            with contextlib.suppress(FileNotFoundError):
                await repo.delete(row.id)

    async def resolve_template(self, name: str) -> TemplateRow:
        """The template ``Sandbox.create(name)`` starts from, fetching a snapshot from the repository
        when it is not here: an unknown name that is a snapshot ID in the repository, or a snapshot
        template whose directory is gone (see the module docstring)."""
        try:
            tpl = self.orch.templates.resolve(name)
        except TemplateNotFound:
            if await self.fetch(name) is None:
                raise
            return self.orch.templates.resolve(name)
        if tpl.kind == "snapshot" and self.orch.repository is not None:
            row = self.store.get_snapshot(tpl.id)
            if row is not None and row.id == tpl.id and row.state == "ready" and not Path(row.dir).is_dir():
                await self.fetch(row.id)
        return tpl

    async def fetch(self, snapshot_id: str) -> SnapshotRow | None:
        """Make snapshot ``snapshot_id`` available here from the repository: download and verify its
        layers (sha256 + size), place them under ``<state>/snapshots/<id>`` (atomically: complete or
        absent), record the row (``published``) and its template. Returns the row; None if the
        repository does not have it (or there is no repository). A present snapshot is returned as is."""
        repo = self.orch.repository
        if repo is None or not is_valid_id(snapshot_id):
            return None
        if self._fetch_lock is None:
            self._fetch_lock = asyncio.Lock()
        async with self._fetch_lock:  # fetches are rare: one at a time, and never twice the same
            return await self._fetch_locked(repo, snapshot_id)

    async def _fetch_locked(self, repo: Any, snapshot_id: str) -> SnapshotRow | None:
        from aenv.snapshots.manifest import ManifestError
        from aenv.snapshots.publish import materialize

        row = self.store.get_snapshot(snapshot_id)
        if row is not None and row.id != snapshot_id:
            row = None  # a snapshot *named* like this ID: not the one asked for
        if row is not None and (row.state != "ready" or Path(row.dir).is_dir()):
            return row if row.state == "ready" else None
        try:
            manifest = await repo.find_manifest(snapshot_id)
        except (ManifestError, ValueError) as exc:
            raise RuntimeFailure(f"snapshot '{snapshot_id}' in the repository is unreadable: {exc}") from None
        except Exception as exc:
            raise RuntimeFailure(f"snapshot repository unreachable looking up '{snapshot_id}': {_short(exc)}") from None
        if manifest is None:
            return None
        runtime = self.orch.runtime.name
        if manifest.runtime != runtime:
            raise StateError(
                f"snapshot '{snapshot_id}' was taken on the {manifest.runtime} runtime; this server runs {runtime}",
                snapshot_id=snapshot_id,
            )
        template = self._image_template_for(snapshot_id, manifest.template_id, manifest.meta.get("template_alias"))
        dest = Path(row.dir) if row is not None else self.orch.settings.snapshots_dir / snapshot_id
        t0 = time.perf_counter()
        try:
            result = await materialize(repo, manifest, dest, [str(p) for p in (template.lowers or [template.rootfs])])
        except ManifestError as exc:
            raise RuntimeFailure(f"snapshot '{snapshot_id}' in the repository is unusable: {exc}") from None
        except Exception as exc:
            raise RuntimeFailure(f"fetching snapshot '{snapshot_id}' from the repository failed: {_short(exc)}") from None
        size = await asyncio.to_thread(_du, dest)
        if row is None:
            row = SnapshotRow(
                id=snapshot_id, name=manifest.name, sandbox_id=manifest.meta.get("sandbox_id"),
                parent_id=manifest.parent, template_id=template.id, runtime=runtime, mode=manifest.mode,
                state="ready", internal=False, created_at=manifest.created_at or now(), dir=str(dest),
                result=result, published=True, size_bytes=size,
            )
            self.store.put_snapshot(row)
        else:
            row.result, row.published, row.size_bytes = result, True, size
            self.store.update_snapshot(snapshot_id, result=result, published=True, size_bytes=size)
        existing = self.store.get_template(snapshot_id)
        if existing is None or existing.id != snapshot_id:
            alias = manifest.name if manifest.name and self.store.get_template(manifest.name) is None else None
            meta = manifest.meta
            self.orch.templates.register(
                alias=alias, kind="snapshot", rootfs=_path(template.rootfs), lowers=[_path(p) for p in template.lowers],
                config={**template.config, "snapshot": snapshot_id}, source=f"snapshot {snapshot_id} (repository)",
                template_id=snapshot_id, cpu_count=meta.get("cpu_count") if isinstance(meta.get("cpu_count"), int) else None,
                memory_mb=meta.get("memory_mb") if isinstance(meta.get("memory_mb"), int) else None, size_bytes=size,
            )
        log.info("snapshot=%s fetched from the repository in %.2fs (%d layers, %d bytes)", snapshot_id,
                 time.perf_counter() - t0, len(manifest.layers), sum(layer.size for layer in manifest.layers))
        return row

    def _image_template_for(self, snapshot_id: str, template_id: str, alias: Any) -> TemplateRow:
        tpl = self.store.get_template(template_id)
        if tpl is None or tpl.id != template_id:
            tpl = self.store.get_template(alias) if isinstance(alias, str) and alias else None
            if tpl is not None and tpl.alias != alias:
                tpl = None
        if tpl is None or tpl.kind == "snapshot":
            raise StateError(
                f"snapshot '{snapshot_id}' runs on template '{alias or template_id}', which this server does not "
                "have: pull or build it first", snapshot_id=snapshot_id,
            )
        return tpl

    # ---- start from snapshot --------------------------------------------------------------------
    def snapshot_for_template(self, template_id: str) -> SnapshotRow | None:
        tpl = self.store.get_template(template_id)
        if tpl is None or tpl.kind != "snapshot":
            return None
        return self.get(tpl.id)

    # ---- fork -----------------------------------------------------------------------------------
    async def fork(self, sandbox_id: str, count: int, timeout: int | None) -> list[LiveSandbox | AenvError]:
        if not 1 <= count <= MAX_FORK:
            raise InvalidRequest(f"count must be between 1 and {MAX_FORK}")
        timeout = timeout if timeout is not None else self.orch.settings.default_timeout
        self.orch._check_timeout(timeout)
        rt = self.runtime
        src = self.orch.get(sandbox_id)
        if len(self.orch._live) + count > self.orch.settings.max_sandboxes:
            raise CapacityError(f"forking {count} would exceed the sandbox limit", retry_after=5)
        async with src.lock:
            require_state(src.id, src.state, SandboxState.RUNNING, action="fork")
            scratch_id = new_id()
            scratch = self.orch.settings.snapshots_dir / scratch_id
            scratch.mkdir(parents=True, exist_ok=True)
            children: list[LiveSandbox] = []
            for _ in range(count):
                children.append(self._child_of(src, timeout, depends_on=[scratch_id]))
            snap_row = SnapshotRow(
                id=scratch_id, sandbox_id=src.id, parent_id=src.row.lineage_head,
                template_id=self._base_template(src.row.template_id), runtime=self.orch.runtime.name,
                mode="full", state="creating", internal=True, created_at=now(), dir=str(scratch),
            )
            self.store.put_snapshot(snap_row)
            try:
                fault_point("fork.stored")
                result, states = await rt.fork(src.id, [c.spec for c in children], scratch)
            except BaseException:
                for child in children:
                    self.orch._live.pop(child.id, None)
                    await self.orch._forget(child.row, child.spec)
                self.store.delete_snapshot(scratch_id)
                shutil.rmtree(scratch, ignore_errors=True)
                raise
            fault_point("fork.done")
            snap_row.mode = result.mode
            snap_row.state = "ready"
            snap_row.result = {"layers": list(result.layers), "data": result.data}
            self.store.update_snapshot(scratch_id, mode=result.mode, state="ready", result=snap_row.result)
            # The source now also runs from the fork point (vm restores it from the same frozen state).
            src.row.lineage_head = scratch_id
            if result.data.get("source_depends"):
                src.row.depends_on = sorted(set(src.row.depends_on) | {scratch_id})
            self.store.update_sandbox(src.id, lineage_head=scratch_id, depends_on=src.row.depends_on)
            out: list[LiveSandbox | AenvError] = []
            for child, state in zip(children, states, strict=True):
                if isinstance(state, BaseException):
                    self.orch._live.pop(child.id, None)
                    await self.orch._forget(child.row, child.spec)
                    out.append(state if isinstance(state, AenvError) else AenvError(f"fork failed: {state}"))
                    continue
                child.row.state = SandboxState.RUNNING.value
                child.row.started_at = now()
                child.row.end_at = child.row.started_at + timeout
                child.row.runtime_state = state.data
                child.row.lineage_head = scratch_id
                self.store.update_sandbox(
                    child.id, state=child.row.state, started_at=child.row.started_at, end_at=child.row.end_at,
                    runtime_state=state.data, lineage_head=scratch_id,
                )
                out.append(child)
        self.collect_garbage()
        log.info("sandbox=%s forked into %d (%d ok) mode=%s", src.id, count, sum(not isinstance(o, AenvError) for o in out), result.mode)
        return out

    def _child_of(self, src: LiveSandbox, timeout: int, depends_on: list[str]) -> LiveSandbox:
        from aenv.core.orchestrator import LiveSandbox

        self.orch._seq += 1
        t = now()
        row = replace(
            src.row,
            id=new_id(),
            state=SandboxState.STARTING.value,
            started_at=t,
            end_at=t + timeout,
            paused_at=None,
            access_token=new_token() if src.row.access_token else None,
            runtime_state={},
            idempotency_key=None,
            created_seq=self.orch._seq,
            metadata=dict(src.row.metadata),
            env_vars=dict(src.row.env_vars),
            depends_on=sorted(set(src.row.depends_on) | set(depends_on)),
        )
        spec = replace(
            src.spec, sandbox_id=row.id, workdir=self.orch.settings.sandboxes_dir / row.id, access_token=row.access_token
        )
        child = LiveSandbox(row=row, spec=spec)
        self.orch._live[row.id] = child
        self.store.put_sandbox(row)
        return child

    # ---- rollback -------------------------------------------------------------------------------
    async def rollback(self, sandbox_id: str, snapshot_id: str) -> LiveSandbox:
        rt = self.runtime
        sbx = self.orch.get(sandbox_id)
        target = self.get(snapshot_id)
        if not Path(target.dir).is_dir():  # files lost here: fetch them back from the repository
            target = await self.fetch(target.id) or target
        async with sbx.lock:
            require_state(sbx.id, sbx.state, SandboxState.RUNNING, SandboxState.PAUSED, action="roll back")
            chain = {r.id for r in self.lineage(sbx.row.lineage_head)}
            if target.id not in chain:
                raise Conflict(
                    f"snapshot '{snapshot_id}' is not in the lineage of sandbox '{sandbox_id}'",
                    sandbox_id=sandbox_id, snapshot_id=snapshot_id,
                )
            state = await rt.rollback(sbx.id, sbx.spec, _path(target.dir), result_of(target))
            sbx.row.state = SandboxState.RUNNING.value
            sbx.row.paused_at = None
            sbx.row.runtime_state = state.data
            sbx.row.lineage_head = target.id
            sbx.row.depends_on = sorted(set(sbx.row.depends_on) | {target.id})
            self.store.update_sandbox(
                sbx.id, state=sbx.row.state, paused_at=None, runtime_state=state.data,
                lineage_head=target.id, depends_on=sbx.row.depends_on,
            )
        log.info("sandbox=%s rolled back to snapshot=%s", sandbox_id, target.id)
        return sbx

    # ---- delete & GC ----------------------------------------------------------------------------
    def dependents(self, snapshot_id: str) -> list[str]:
        return [s.id for s in self.orch._live.values() if snapshot_id in s.row.depends_on]

    def layered_on(self, row: SnapshotRow) -> list[str]:
        """Other snapshots whose recorded layers (``result.data["lowers"]``, e.g. ns overlay lowers of an
        incremental snapshot) live inside this snapshot's directory."""
        prefix = row.dir.rstrip("/") + "/"

        def uses(other: SnapshotRow) -> bool:
            lowers = other.result.get("data", {}).get("lowers")
            return other.id != row.id and isinstance(lowers, list) and any(str(p).startswith(prefix) for p in lowers)

        return [other.id for other in self.store.list_snapshots() if uses(other)]

    async def delete(self, snapshot_id: str) -> None:
        await self._settled(snapshot_id)
        row = self.get(snapshot_id)
        users = self.dependents(row.id)
        if users:
            raise Conflict(f"snapshot '{snapshot_id}' is used by sandboxes {', '.join(users[:5])}", snapshot_id=snapshot_id)
        layered = self.layered_on(row)
        if layered:
            raise Conflict(
                f"snapshot '{snapshot_id}' is a layer of snapshots {', '.join(layered[:5])}; delete those first",
                snapshot_id=snapshot_id,
            )
        self.store.delete_template(row.id)
        self.store.delete_snapshot(row.id)
        shutil.rmtree(row.dir, ignore_errors=True)
        if self.orch.repository is not None:  # published or not: a publish may be half-way
            try:
                await self.orch.repository.delete(row.id)
            except FileNotFoundError:
                pass
            except Exception as exc:
                log.warning("snapshot=%s could not be deleted from the repository: %s", row.id, _short(exc))

    def collect_garbage(self) -> None:
        """Remove internal (fork) snapshots that no live sandbox needs any more."""
        needed = {d for s in self.orch._live.values() for d in s.row.depends_on}
        heads = {s.row.lineage_head for s in self.orch._live.values()}
        for row in self.store.list_snapshots():
            if row.internal and row.id not in needed and row.id not in heads and not self.children(row.id):
                self.store.delete_snapshot(row.id)
                shutil.rmtree(row.dir, ignore_errors=True)


def _path(p: str) -> Path:
    return Path(p)


def _short(exc: BaseException) -> str:
    """The first line of an error (obstore's carry multi-line debug dumps)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def _du(path: Path) -> int:
    """Disk used by a snapshot directory. A hard-linked file (a vm snapshot's base RAM, shared with
    its template and every other snapshot of it; parent RAM layers) counts its share only."""
    total = 0
    for p in path.rglob("*"):
        with contextlib.suppress(OSError):
            st = p.lstat()
            total += st.st_blocks * 512 // max(1, st.st_nlink)
    return total


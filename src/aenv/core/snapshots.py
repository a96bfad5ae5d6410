"""Snapshot, fork and rollback flows: the checkpoint tree of every sandbox.

* A snapshot is a directory under ``<state>/snapshots/<id>`` written by the runtime, a row in the store
  (written first, state ``creating``), and a template of kind ``snapshot`` so ``Sandbox.create(<id>)``
  works. Publishing to the snapshot repository and fetching back from it is ``sync.py``'s job.
* Lineage: every sandbox has a ``lineage_head`` (the snapshot its state descends from). A new snapshot's
  parent is that head; rollback accepts any snapshot on the chain from the head to the root.
* Fork is written here once, for every runtime: a snapshot in the best mode the runtime has for the
  source, then one restore per child; the runtimes only supply ``snapshot`` and ``create_from_snapshot``.
* Dependencies: a sandbox started from a snapshot may need its files while alive (ns overlay lowers, vm
  RAM files): ``depends_on`` lists them; such snapshots cannot be deleted until nothing depends on them,
  and internal fork snapshots are collected as soon as nothing does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from aenv.core import network as net
from aenv.core.context import Context
from aenv.core.ids import new_id, new_token
from aenv.core.models import require_state
from aenv.core.sync import SnapshotSync, disk_usage, short_error
from aenv.core.table import LiveSandbox
from aenv.core.volumes import as_read_only
from aenv.errors import AenvError, CapacityError, Conflict, InvalidRequest, SnapshotNotFound, StateError
from aenv.faults import fault_point
from aenv.kinds import SandboxState, SnapshotMode, TemplateKind
from aenv.runtime.base import UNFINISHED_MARKER, MachineBound, SnapshotCapable, SnapshotResult
from aenv.store.sqlite import SnapshotRow, TemplateRow, now

log = logging.getLogger("aenv.core")

MAX_FORK = 64


def result_of(row: SnapshotRow) -> SnapshotResult:
    return SnapshotResult.from_record(row.mode, row.result, parent=row.parent_id)


def snapshot_id_of(tpl: TemplateRow) -> str:
    """The snapshot a snapshot-kind template starts from: its own ID (a user snapshot), or the one its
    config names (a built template, which keeps its ID across rebuilds)."""
    return str(tpl.config.get("snapshot") or tpl.id)


class SnapshotFlows:
    def __init__(self, ctx: Context, sync: SnapshotSync) -> None:
        self.ctx = ctx
        self.store = ctx.store
        self.sync = sync
        self._settling: dict[str, asyncio.Task[None]] = {}  # snapshot ID -> waits for its files
        # (team, sandboxes, vcpus, memory_mb) -> raise when over the team's quota (admission.py)
        self.check_quota: Callable[[str, int, int, int], None] = lambda *_: None

    @property
    def runtime(self) -> SnapshotCapable:
        rt = self.ctx.runtime
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
        try:
            wanted = SnapshotMode(mode)
        except ValueError:
            raise InvalidRequest(f"unknown snapshot mode '{mode}': use full or filesystem") from None
        rt = self.runtime
        sbx = self.ctx.table.get(sandbox_id)
        async with sbx.lock:
            require_state(sbx.id, sbx.state, SandboxState.RUNNING, SandboxState.PAUSED, action="snapshot")
            return await self._snapshot_locked(rt, sbx, name, wanted, internal=False)

    async def checkpoint(self, sandbox_id: str, mode: SnapshotMode) -> SnapshotRow:
        """An internal snapshot of a running sandbox (a template build's step): not a template of its
        own, never published, collected once nothing points at it."""
        rt = self.runtime
        sbx = self.ctx.table.get(sandbox_id)
        async with sbx.lock:
            require_state(sbx.id, sbx.state, SandboxState.RUNNING, action="snapshot")
            return await self._snapshot_locked(rt, sbx, None, mode, internal=True)

    async def _snapshot_locked(
        self, rt: SnapshotCapable, sbx: LiveSandbox, name: str | None, mode: SnapshotMode, *, internal: bool
    ) -> SnapshotRow:
        """Snapshot ``sbx`` (its lock held): row first, then the runtime, then the row says ready.
        ``internal``: a fork point (hidden, collected when nothing needs it, never published)."""
        snap_id = new_id()
        directory = self.ctx.settings.snapshots_dir / snap_id
        row = SnapshotRow(
            id=snap_id,
            name=name,
            sandbox_id=sbx.id,
            parent_id=sbx.row.lineage_head,
            template_id=self._base_template(sbx.row.template_id),
            runtime=self.ctx.runtime.name,
            mode=mode,
            state="creating",
            internal=internal,
            created_at=now(),
            dir=str(directory),
            owner=sbx.row.owner,
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
        if mode is SnapshotMode.FULL and result.mode is not SnapshotMode.FULL:
            # Never silently less than asked.
            self.store.delete_snapshot(snap_id)
            shutil.rmtree(directory, ignore_errors=True)
            raise StateError(
                f"the {self.ctx.runtime.name} runtime can only take filesystem snapshots here "
                "(process memory needs CRIU >= 4.2 or the vm runtime); ask for mode=filesystem"
            )
        row.mode = result.mode
        row.state = "ready"
        row.result = result.to_record()
        row.size_bytes = disk_usage(directory)
        self.store.update_snapshot(snap_id, mode=row.mode, state=row.state, result=row.result, size_bytes=row.size_bytes)
        sbx.row.lineage_head = snap_id
        self.store.update_sandbox(sbx.id, lineage_head=snap_id)
        if not internal:
            self._register_template(row, sbx)
        if result.pending is not None:
            self._settle_later(row, result, publish=not internal)
        elif not internal:
            self.sync.publish(row)
        log.info("sandbox=%s snapshot=%s mode=%s parent=%s", sbx.id, snap_id, row.mode, row.parent_id)
        return row

    def _settle_later(self, row: SnapshotRow, result: SnapshotResult, *, publish: bool) -> None:
        """The runtime returned before the snapshot's files were all written (the vm runtime writes
        RAM layer and disk while the sandbox runs on). When they are: record the final size and
        result, then publish. If they cannot be: the snapshot is deleted, loudly."""

        pending = result.pending
        assert pending is not None

        async def run() -> None:
            try:
                await pending
            except Exception as exc:
                log.error("snapshot=%s: its files could not be written (%s); deleting it", row.id, short_error(exc))
                self._discard(row)
                return
            if self.store.get_snapshot(row.id) is None:
                return  # deleted meanwhile
            row.size_bytes = disk_usage(Path(row.dir))
            row.result = result.to_record()  # the runtime completed its data while writing the files
            self.store.update_snapshot(row.id, result=row.result, size_bytes=row.size_bytes)
            if publish:
                self.sync.publish(row)

        task = asyncio.create_task(run(), name=f"aenv-snapshot-settle-{row.id}")
        self._settling[row.id] = task
        task.add_done_callback(lambda _: self._settling.pop(row.id, None))

    async def aclose(self) -> None:
        """Let snapshots whose files are being written settle (a restart discards unfinished ones)."""
        for snapshot_id in list(self._settling):
            await self._settled(snapshot_id)

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
        live = self.ctx.table.find(row.sandbox_id or "")
        if live is not None and live.row.lineage_head == row.id:
            live.row.lineage_head = row.parent_id
            self.store.update_sandbox(live.id, lineage_head=row.parent_id)

    def discard_unfinished(self) -> list[str]:
        """At start-up: a snapshot whose row still says ``creating`` (the server stopped before the
        runtime finished), or whose files a stopped server was still writing (the runtime marks them
        with UNFINISHED_MARKER until done), is incomplete; delete it. Then collect the fork points
        nothing needs any more."""
        out = []
        for row in self.store.list_snapshots():
            if row.state == "creating" or (Path(row.dir) / UNFINISHED_MARKER).exists():
                log.warning("snapshot=%s was still being written when the server stopped; deleting it", row.id)
                self._discard(row)
                out.append(row.id)
        self.collect_garbage()
        return out

    def _register_template(self, row: SnapshotRow, sbx: LiveSandbox) -> None:
        """Make the snapshot startable by ID or name: it carries its image template's rootfs and config."""
        base = self.store.get_template(row.template_id)
        self.ctx.templates.register(
            alias=row.name,
            kind=TemplateKind.SNAPSHOT,
            rootfs=Path(base.rootfs) if base else Path(row.dir),
            lowers=[Path(p) for p in base.lowers] if base else [],
            config={**(base.config if base else {}), "snapshot": row.id},
            source=f"snapshot of {sbx.id}",
            template_id=row.id,
            cpu_count=sbx.row.cpu_count,
            memory_mb=sbx.row.memory_mb,
            size_bytes=row.size_bytes,
            owner=row.owner,
        )

    def _base_template(self, template_id: str) -> str:
        """Snapshots remember the image template at the root of their chain."""
        tpl = self.store.get_template(template_id)
        if tpl is not None and tpl.kind is TemplateKind.SNAPSHOT:
            snap = self.store.get_snapshot(snapshot_id_of(tpl))
            if snap is not None:
                return snap.template_id
        return template_id

    # ---- start from snapshot --------------------------------------------------------------------
    def snapshot_for_template(self, template_id: str) -> SnapshotRow | None:
        """The snapshot a create from this template restores, checked restorable here (see below)."""
        tpl = self.store.get_template(template_id)
        if tpl is None or tpl.kind is not TemplateKind.SNAPSHOT:
            return None
        return self.check_restorable(self.get(snapshot_id_of(tpl)))

    def check_restorable(self, row: SnapshotRow) -> SnapshotRow:
        """``row``, unless its saved state was taken on another machine than this node's (vm: CPU model,
        QEMU): then ``MachineMismatch``, before anything is stored or started."""
        rt = self.ctx.runtime
        if isinstance(rt, MachineBound):
            rt.check_restore(f"snapshot '{row.id}'", result_of(row))
        return row

    # ---- fork -----------------------------------------------------------------------------------
    async def fork(self, sandbox_id: str, count: int, timeout: int | None) -> list[LiveSandbox | AenvError]:
        """``count`` copies of a running sandbox, the source running on: one snapshot (internal, in the
        best mode the runtime has for it) then one restore per child, side by side. A child that fails
        is an error in its place of the result; the others are fine."""
        if not 1 <= count <= MAX_FORK:
            raise InvalidRequest(f"count must be between 1 and {MAX_FORK}")
        timeout = timeout if timeout is not None else self.ctx.settings.default_timeout
        self.ctx.check_timeout(timeout)
        rt = self.runtime
        src = self.ctx.table.get(sandbox_id)
        if len(self.ctx.table) + count > self.ctx.settings.max_sandboxes:
            raise CapacityError(f"forking {count} would exceed the sandbox limit", retry_after=5)
        async with src.lock:
            require_state(src.id, src.state, SandboxState.RUNNING, action="fork")
            mode = await rt.fork_mode(src.id)
            # the children count for the parent's team; checked with no await before they enter the table
            self.check_quota(src.row.owner, count, count * src.row.cpu_count, count * src.row.memory_mb)
            children = [self._child_of(src, timeout) for _ in range(count)]
            try:
                fault_point("fork.stored")
                point = await self._snapshot_locked(rt, src, None, mode, internal=True)
                for child in children:  # the fork point's files back the children
                    await net.enforce(self.ctx.runtime, child.row)  # the parent's policy, before the child has a network
                    child.row.depends_on = sorted(set(child.row.depends_on) | {point.id})
                    self.store.update_sandbox(child.id, depends_on=child.row.depends_on)
                result = result_of(point)
                states = await asyncio.gather(
                    *(rt.create_from_snapshot(c.spec, Path(point.dir), result) for c in children), return_exceptions=True
                )
            except BaseException:
                for child in children:
                    await self.ctx.forget(child.row)
                raise
            fault_point("fork.done")
            out: list[LiveSandbox | AenvError] = []
            for child, state in zip(children, states, strict=True):
                if isinstance(state, BaseException):
                    await self.ctx.forget(child.row)
                    out.append(state if isinstance(state, AenvError) else AenvError(f"fork failed: {state}"))
                    continue
                child.row.state = SandboxState.RUNNING
                child.row.started_at = now()
                child.row.end_at = child.row.started_at + timeout
                child.row.runtime_state = state.data
                child.row.lineage_head = point.id
                self.store.update_sandbox(
                    child.id, state=child.row.state, started_at=child.row.started_at, end_at=child.row.end_at,
                    runtime_state=state.data, lineage_head=point.id,
                )
                out.append(child)
        self.collect_garbage()
        log.info("sandbox=%s forked into %d (%d ok) mode=%s", src.id, count,
                 sum(not isinstance(o, AenvError) for o in out), point.mode)
        return out

    def _child_of(self, src: LiveSandbox, timeout: int) -> LiveSandbox:
        t = now()
        row = replace(
            src.row,
            id=new_id(),
            state=SandboxState.STARTING,
            started_at=t,
            end_at=t + timeout,
            paused_at=None,
            access_token=new_token() if src.row.access_token else None,
            traffic_token=new_token() if src.row.traffic_token else None,
            network=dict(src.row.network),
            runtime_state={},
            idempotency_key=None,
            created_seq=self.ctx.table.next_seq(),
            metadata=dict(src.row.metadata),
            env_vars=dict(src.row.env_vars),
            depends_on=list(src.row.depends_on),
            volume_mounts=as_read_only(src.row.volume_mounts),  # the parent keeps the one writer's mount
        )
        spec = replace(
            src.spec, sandbox_id=row.id, workdir=self.ctx.settings.sandboxes_dir / row.id, access_token=row.access_token,
            volumes=tuple(replace(v, read_only=True) for v in src.spec.volumes),
        )
        child = LiveSandbox(row=row, spec=spec)
        self.store.put_sandbox(row)  # first: in cluster mode a fenced node refuses here, holding nothing
        self.ctx.table.add(child)
        return child

    # ---- rollback -------------------------------------------------------------------------------
    async def rollback(self, sandbox_id: str, snapshot_id: str) -> LiveSandbox:
        rt = self.runtime
        sbx = self.ctx.table.get(sandbox_id)
        target = self.check_restorable(self.get(snapshot_id))
        if not Path(target.dir).is_dir():  # files lost here: fetch them back from the repository
            target = await self.sync.fetch(target.id) or target
        async with sbx.lock:
            require_state(sbx.id, sbx.state, SandboxState.RUNNING, SandboxState.PAUSED, action="roll back")
            chain = {r.id for r in self.lineage(sbx.row.lineage_head)}
            if target.id not in chain:
                raise Conflict(
                    f"snapshot '{snapshot_id}' is not in the lineage of sandbox '{sandbox_id}'",
                    sandbox_id=sandbox_id, snapshot_id=snapshot_id,
                )
            state = await rt.rollback(sbx.id, sbx.spec, Path(target.dir), result_of(target))
            sbx.row.state = SandboxState.RUNNING
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
        return self.ctx.table.depending_on(snapshot_id)

    def layered_on(self, row: SnapshotRow) -> list[str]:
        """Other snapshots that stack on a layer inside this snapshot's directory (ns: an incremental
        snapshot sits on its parent's ``upper``)."""
        prefix = row.dir.rstrip("/") + "/"
        return [
            other.id for other in self.store.list_snapshots()
            if other.id != row.id and any(p.startswith(prefix) for p in result_of(other).stack)
        ]  # fmt: skip

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
        await self.sync.delete(row.id)

    def collect_garbage(self) -> None:
        """Remove internal snapshots (fork points, build steps) that no live sandbox and no template
        needs any more. One still being written is not garbage: nothing points at it *yet* (another
        build's collection removed a step snapshot mid-capture; a restart discards those that were
        left half-written: ``discard_unfinished``)."""
        in_use = self.ctx.table.snapshots_in_use() | {
            snapshot_id_of(t) for t in self.store.list_templates() if t.kind is TemplateKind.SNAPSHOT
        }
        for row in self.store.list_snapshots():
            if row.state == "creating":
                continue
            if row.internal and row.id not in in_use and not self.children(row.id):
                self.store.delete_snapshot(row.id)
                shutil.rmtree(row.dir, ignore_errors=True)

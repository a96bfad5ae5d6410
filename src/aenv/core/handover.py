"""Published pauses (cluster mode with a snapshot store): a paused sandbox another node can run again under
the same id once its own node is declared dead.

* **Publish.** After a pause that keeps memory answers, a background task takes a snapshot of the paused
  sandbox (the best mode the runtime has for it: ns with CRIU and vm keep the processes; otherwise the
  files only), uploads it to the snapshot store and only then records in the directory binding that the
  pause is published (``NodeDirectory.publish_pause``: the snapshot id and what a node needs to run the
  sandbox again: its template, sizes, settings, metadata, env vars and its envd and traffic tokens). The
  pause answers as fast as without a cluster; until the upload finished the pause is not published.
  The snapshot is internal (not listed, never a template here), kept while it is the sandbox's lineage
  head; a kill of the sandbox takes the snapshots it published out of the store (those this server
  process published: a restart forgets them, and the store keeps them); on an adopting node, also the
  snapshot it was adopted from (listed there as a snapshot until then).
  A sandbox that mounts volumes publishes their data with its pause (each volume's directory as a
  snapshot of its own in the store, taken while the sandbox is frozen: E2B's volumes have one writer),
  named in the pause with the volume's ID, name, owner and token. A vm sandbox is not published: a vm
  snapshot's disk is layered on its node's own template build, which no other node has.
* **Withdraw.** A resume here (connect, autoResume) withdraws the published pause: the state it names is
  stale from then on. A publish that finishes after a resume, or after a later pause, records nothing.
* **Adopt.** ``adopt`` (the gateway's ``connect``/``resume`` of a sandbox lost with its node) fetches the
  snapshot from the store, takes the binding over in one fenced script (``keys.ADOPT``: only while it
  still says lost with that snapshot, so two nodes cannot both adopt), takes its volumes over
  (``keys.ADOPT_VOLUME``: only from the dead node, fenced like the binding; their data fetched from the
  store into volumes of the same IDs, names and tokens here), and starts the sandbox from the
  snapshot under its old id and tokens, its volumes mounted where they were. A failed start gives the binding back (lost, published). The dead
  node, should it return, kills its copy: the directory no longer binds the id to it (``recovery.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aenv.core import network as net
from aenv.core.snapshots import result_of
from aenv.core.table import LiveSandbox
from aenv.directory.node import NodeDirectory, NotAdoptable, PublishedPause
from aenv.errors import AenvError, Conflict, SandboxNotFound, StateError
from aenv.kinds import SandboxState, SnapshotMode
from aenv.store.sqlite import SandboxRow, now

if TYPE_CHECKING:
    from aenv.core.orchestrator import Orchestrator

log = logging.getLogger("aenv.core")

# The row fields a published pause carries to the adopting node (the rest is the node's own: runtime
# state, lineage, creation order); its volumes travel beside them (``volumes``).
CARRIED = ("alias", "cpu_count", "memory_mb", "disk_mb", "auto_pause", "auto_resume", "auto_pause_memory",
           "allow_internet", "metadata", "env_vars", "access_token", "traffic_token", "network", "has_network", "owner",
           "volume_mounts")  # fmt: skip


def carried(row: SandboxRow) -> dict[str, Any]:
    """What of ``row`` travels with its published pause."""
    return {name: getattr(row, name) for name in CARRIED}


class PauseHandover:
    """Publishes this node's pauses and adopts the published pauses of dead nodes (see the module doc)."""

    def __init__(self, orch: Orchestrator, directory: NodeDirectory) -> None:
        self.orch = orch
        self.directory = directory
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._adopting: dict[str, asyncio.Lock] = {}
        self._uploaded: dict[str, list[str]] = {}  # sandbox id -> its pause snapshots in the store
        self._adopted_from: dict[str, str] = {}  # sandbox id -> the fetched snapshot it was adopted from
        self._cleanups: set[asyncio.Task[None]] = set()

    # ---- publish --------------------------------------------------------------------------------
    def on_event(self, event: str, row: SandboxRow, extra: dict[str, str]) -> None:
        """An orchestrator hook (must not block): a pause keeping memory is published, a resume withdraws."""
        if event == "paused" and row.pause_mode is SnapshotMode.FULL and row.paused_at is not None:
            if row.runtime == "vm":  # its disk is layered on this node's template build (runtime/vm/snapshot.py)
                log.info("sandbox=%s: its pause is not published (a vm snapshot runs only on its node)", row.id)
                return
            task = asyncio.get_running_loop().create_task(self._publish(row.id, row.paused_at),
                                                          name=f"aenv-pause-publish-{row.id}")  # fmt: skip
            self._tasks[row.id] = task
            task.add_done_callback(lambda t: self._tasks.pop(row.id, None) if self._tasks.get(row.id) is t else None)
        elif event == "resumed":
            self.directory.unpublish_pause(row.id)
        elif event == "killed" and (row.id in self._uploaded or row.id in self._adopted_from):
            uploaded, adopted_from = self._uploaded.pop(row.id, []), self._adopted_from.pop(row.id, None)
            orch = self.orch

            async def delete() -> None:
                if adopted_from is not None:  # here, its template and the store's copy: nothing needs them now
                    with contextlib.suppress(AenvError):
                        await orch.snapshots.delete(adopted_from)
                for snapshot_id in uploaded:
                    await orch.sync.delete(snapshot_id)

            cleanup = asyncio.get_running_loop().create_task(delete(), name=f"aenv-pause-unpublish-{row.id}")
            self._cleanups.add(cleanup)
            cleanup.add_done_callback(self._cleanups.discard)

    def _still_paused(self, sbx: LiveSandbox, paused_at: float) -> bool:
        return sbx.id in self.orch.table and sbx.state is SandboxState.PAUSED and sbx.row.paused_at == paused_at

    async def _publish(self, sandbox_id: str, paused_at: float) -> None:
        t0 = now()
        snapshots = self.orch.snapshots
        try:
            sbx = self.orch.table.get(sandbox_id)
            async with sbx.lock:
                if not self._still_paused(sbx, paused_at):
                    return
                rt = snapshots.runtime
                mode = await rt.fork_mode(sbx.id)
                snap = await snapshots._snapshot_locked(rt, sbx, None, mode, internal=True)
            await snapshots._settled(snap.id)  # vm: its files are written after the snapshot answered
            await self.orch.sync.publish_now(snap)
            self._uploaded.setdefault(sandbox_id, []).append(snap.id)
            volumes = await self._publish_volumes(sbx, paused_at)
            async with sbx.lock:
                if not self._still_paused(sbx, paused_at):
                    log.info("sandbox=%s resumed while its pause was published: not recorded", sandbox_id)
                    return
                row = {**carried(sbx.row), "volumes": volumes}
                published = await asyncio.to_thread(self.directory.publish_pause, sandbox_id, snap.id, row)
        except Exception as exc:  # noqa: BLE001 - the pause stands; only its copy elsewhere is missing
            log.warning("sandbox=%s: its pause is not published (another node cannot resume it): %s", sandbox_id, exc)
            return
        if published:
            log.info("sandbox=%s pause published as snapshot=%s mode=%s in %.2fs", sandbox_id, snap.id, snap.mode,
                     now() - t0)  # fmt: skip

    async def _publish_volumes(self, sbx: LiveSandbox, paused_at: float) -> list[dict[str, Any]]:
        """Each volume the sandbox mounts, its directory published as a snapshot of its own (while the
        sandbox stays paused: nothing of it writes there meanwhile). Raises what failed."""
        from aenv.core.ids import new_id
        from aenv.snapshots.publish import publish_snapshot

        out: list[dict[str, Any]] = []
        if not sbx.row.volume_mounts:
            return out
        repo, vols = self.orch.ctx.repository, self.orch.volumes
        for vid in dict.fromkeys(str(m["volumeID"]) for m in sbx.row.volume_mounts):
            vol = vols.log.get(vid)
            if vol is None or repo is None:
                raise StateError(f"volume {vid} is gone or there is no snapshot store")
            async with sbx.lock:
                if not self._still_paused(sbx, paused_at):
                    return out
                snapshot_id = new_id()
                await publish_snapshot(repo, snapshot_id=snapshot_id, directory=vols.root, mode="filesystem",
                                       runtime=self.orch.runtime.name, template_id="volume", result={"layers": [vid]},
                                       created_at=now(), meta={"volume": vid, "owner": vol.owner})  # fmt: skip
            self._uploaded.setdefault(sbx.id, []).append(snapshot_id)
            out.append({"id": vid, "name": vol.name, "owner": vol.owner, "token": vol.token,
                        "created_at": vol.created_at, "snapshot": snapshot_id})  # fmt: skip
        return out

    async def _adopt_volumes(self, pause: PublishedPause) -> None:
        """The pause's volumes taken over from the dead node and filled from the store (see module doc)."""
        if not pause.row.get("volumes"):
            return
        repo, vols = self.orch.ctx.repository, self.orch.volumes
        for info in pause.row["volumes"]:
            vid, name, owner = str(info["id"]), str(info["name"]), str(info.get("owner") or "")
            if vols.log.get(vid) is None:
                manifest = await repo.find_manifest(str(info["snapshot"])) if repo is not None else None
                if manifest is None or len(manifest.layers) != 1:
                    raise StateError(f"sandbox '{pause.sandbox_id}': the data of its volume {name} is not in the "
                                     "snapshot store", sandbox_id=pause.sandbox_id)  # fmt: skip
                try:
                    await asyncio.to_thread(self.directory.adopt_volume, vid, owner, name, pause.node)
                except NotAdoptable as exc:
                    raise Conflict(f"sandbox '{pause.sandbox_id}': its volume {name} cannot be taken over: {exc}",
                                   sandbox_id=pause.sandbox_id) from None  # fmt: skip
                fetched = vols.root / f".adopt-{vid}"
                await asyncio.to_thread(shutil.rmtree, fetched, True)
                await repo.get_layer(manifest.layers[0], fetched)
                await vols.adopt(info, fetched)
            self._uploaded.setdefault(pause.sandbox_id, []).append(str(info["snapshot"]))  # gone with the sandbox

    async def settled(self, sandbox_id: str) -> None:
        """Until a publish of ``sandbox_id`` in progress is done (tests, bench)."""
        task = self._tasks.get(sandbox_id)
        if task is not None:
            await asyncio.shield(task)

    async def aclose(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()

    # ---- adopt ----------------------------------------------------------------------------------
    async def adopt(self, sandbox_id: str, timeout: int | None, owner: str | None = None) -> tuple[LiveSandbox, bool]:
        """Run a sandbox lost with its node here, from its published pause, under the same id and tokens.
        Returns (sandbox, resumed) as ``connect`` does: already here (a retried adoption) is a connect.
        ``owner``: only a sandbox of that team (None: any, for an admin); another team's is unknown."""
        lock = self._adopting.setdefault(sandbox_id, asyncio.Lock())
        try:
            async with lock:
                if sandbox_id in self.orch.table:
                    if owner is not None and self.orch.get(sandbox_id).row.owner != owner:
                        raise SandboxNotFound(sandbox_id)
                    return await self.orch.connect(sandbox_id, timeout)
                return await self._adopt(sandbox_id, timeout, owner), True
        finally:
            if not lock.locked():
                self._adopting.pop(sandbox_id, None)

    async def _adopt(self, sandbox_id: str, timeout: int | None, owner: str | None = None) -> LiveSandbox:
        orch, ctx = self.orch, self.orch.ctx
        timeout = timeout if timeout is not None else orch.settings.default_timeout
        ctx.check_timeout(timeout)
        pause = await asyncio.to_thread(self.directory.published_pause, sandbox_id)
        if pause is None or (owner is not None and pause.row.get("owner", "") != owner):
            raise SandboxNotFound(sandbox_id)
        snap = await orch.sync.fetch(pause.snapshot_id)
        if snap is None:
            raise StateError(f"sandbox '{sandbox_id}': its published pause (snapshot {pause.snapshot_id}) is not in "
                             "the snapshot store", sandbox_id=sandbox_id)  # fmt: skip
        orch.snapshots.check_restorable(snap)  # another machine's: refused before the binding is taken
        template = ctx.templates.resolve(snap.id)
        try:
            await asyncio.to_thread(self.directory.adopt, pause)
        except NotAdoptable as exc:
            raise Conflict(f"sandbox '{sandbox_id}' cannot be adopted: {exc}", sandbox_id=sandbox_id) from None
        try:
            await self._adopt_volumes(pause)
        except BaseException:
            with contextlib.suppress(AenvError):
                self.directory.unbind(sandbox_id)
            await asyncio.to_thread(self.directory.give_back, pause)
            raise
        row = self._row(pause, template.id, timeout, snap.id)
        spec = ctx.spec_for(row, template)
        sbx = LiveSandbox(row=row, spec=spec)
        try:
            orch.store.put_sandbox(row)
            orch.table.add(sbx)
            await net.enforce(orch.runtime, row)
            state = await orch.snapshots.runtime.create_from_snapshot(spec, Path(snap.dir), result_of(snap))
        except BaseException:
            await ctx.forget(row)
            await asyncio.to_thread(self.directory.give_back, pause)
            raise
        row.started_at, row.end_at = now(), now() + timeout
        row.state, row.runtime_state = SandboxState.RUNNING, state.data
        orch.store.update_sandbox(row.id, state=row.state, started_at=row.started_at, end_at=row.end_at,
                                  runtime_state=state.data)  # fmt: skip
        log.info("sandbox=%s adopted from node %s (lost: %s), snapshot=%s mode=%s", sandbox_id, pause.node,
                 pause.reason, snap.id, snap.mode)  # fmt: skip
        self._adopted_from[sandbox_id] = snap.id
        orch._notify_running(sandbox_id)
        orch._emit("resumed", row)
        return sbx

    def _row(self, pause: PublishedPause, template_id: str, timeout: int, snapshot_id: str) -> SandboxRow:
        fields = {k: v for k, v in pause.row.items() if k in CARRIED}
        t = now()
        row = SandboxRow(id=pause.sandbox_id, template_id=template_id, state=SandboxState.STARTING,
                         runtime=self.orch.runtime.name, started_at=t, end_at=t + timeout,
                         cpu_count=int(fields.pop("cpu_count")), memory_mb=int(fields.pop("memory_mb")),
                         disk_mb=int(fields.pop("disk_mb")), created_seq=self.orch.table.next_seq(),
                         lineage_head=snapshot_id, depends_on=[snapshot_id], **fields)  # fmt: skip
        return row

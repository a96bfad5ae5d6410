"""The orchestrator: the one front door for every action on sandboxes, snapshots and templates.

Every sandbox action takes the sandbox's lock, checks the lifecycle guard, writes the store *before*
the side effect becomes visible, then calls the runtime. Checkpoints (snapshot, fork, rollback) are
``snapshots.py``'s flows, the snapshot repository is ``sync.py``'s and templates are
``template_flows.py``'s; callers (the API) only ever talk to this class. A background reaper enforces
TTLs (kill, or pause with autoPause); a sandbox's pause and resume transitions are ``pausing.py``'s.
A sampler keeps a short history of resource samples for ``/metrics``. Crash recovery at start-up
(``recovery.py``) re-adopts or cleans every sandbox the store knows and reconciles orphans.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hmac
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from aenv.config import Settings
from aenv.core import bandwidth, mirrors, pausing, team_disk
from aenv.core import network as net
from aenv.core.admission import Admission
from aenv.core.builds import TemplateBuilds
from aenv.core.compose import ComposeFlows
from aenv.core.context import Context
from aenv.core.fleet import KillReport, kill_matching
from aenv.core.ids import new_id, new_token
from aenv.core.models import CreateRequest, ListQuery, SandboxState, require_state
from aenv.core.node_facts import placement_facts
from aenv.core.recovery import recover
from aenv.core.secrets import Secrets
from aenv.core.snapshots import SnapshotFlows, result_of
from aenv.core.sync import SnapshotSync
from aenv.core.table import LiveSandbox, SandboxTable
from aenv.core.template_flows import TemplateFlows
from aenv.core.template_share import TemplateShare
from aenv.core.templates import TemplateCatalog
from aenv.core.uid_slots import UidRanges
from aenv.core.volumes import Volumes
from aenv.errors import (
    AenvError,
    PortNotOpen,
    SandboxUnreachable,
    TemplateNotFound,
)
from aenv.faults import fault_point
from aenv.file_urls import file_signature
from aenv.images import ProgressCallback
from aenv.kinds import SnapshotMode, TemplateKind
from aenv.mux import ByteStream, StreamRefused
from aenv.runtime import ksm
from aenv.runtime.base import BatchSampling, BurstYielding, ResourceSample, Runtime, SnapshotResult
from aenv.store.gone_log import EXPIRED, KILLED, REAPED, GoneLog
from aenv.store.sqlite import SandboxRow, SnapshotRow, Store, TemplateRow, now

__all__ = ["LiveSandbox", "Orchestrator", "file_signature"]

log = logging.getLogger("aenv.core")

METRICS_INTERVAL = 5.0


def _usec(ts: float) -> int:
    """Microseconds since the epoch, rounded as the API's timestamps are: startedAfter is "at or after"
    the instant a client saw (a float compare would put a sandbox after its own startedAt)."""
    return (dt.datetime.fromtimestamp(ts, dt.UTC) - _EPOCH) // dt.timedelta(microseconds=1)


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


class Orchestrator:
    def __init__(self, settings: Settings, store: Store, runtime: Runtime, templates: TemplateCatalog) -> None:
        self.settings = settings
        self.store = store
        self.runtime = runtime
        self.templates = templates
        self.gone = GoneLog(store)
        self.table = SandboxTable(self.gone.find)
        self.volumes = Volumes(settings, store, runtime, self.table)
        self.secrets = Secrets(store, settings.cluster_redis)
        self.ctx = Context(settings, store, runtime, templates, self.table, gone=self.gone, volumes=self.volumes,
                           uid_ranges=UidRanges(settings, store))
        net.configure(settings)
        net.configure_rules(settings, self.secrets, store)
        self.sync = SnapshotSync(self.ctx)
        self.snapshots = SnapshotFlows(self.ctx, self.sync)
        self.template_flows = TemplateFlows(self.ctx)
        self.builds = TemplateBuilds(self.ctx, self, self.snapshots, self.template_flows)
        self.compose = ComposeFlows(settings, self, self.template_flows.builder)  # Compose projects in a sandbox
        self.shared_templates = TemplateShare(self.ctx, self.snapshots, self.template_flows)  # build once, run anywhere
        self.builds.publish, self.sync.template_fetch = self.shared_templates.publish, self.shared_templates.fetch
        self.sync.template_recheck = self.shared_templates.recheck
        self.admission = Admission(settings, self.table)
        self.snapshots.check_quota = self.admission.check_quota  # forks count for the parent's team
        if settings.team_burst_yield and isinstance(runtime, BurstYielding):  # a burst gives way to other teams
            self.admission.on_contention = runtime.yield_bursts
        self._tasks: list[asyncio.Task[None]] = []
        self._idempotency: dict[str, asyncio.Future[LiveSandbox]] = {}
        # Called with a sandbox ID when it becomes usable (created, resumed); must not block. The proxy
        # opens its first envd stream there, ahead of the client's first request.
        self.on_running: list[Callable[[str], None]] = []
        # Called with (event, row, extra) on created, paused, resumed, forked, killed (core/webhooks.py);
        # must not block: a hook logs the event and returns.
        self.on_event: list[Callable[[str, SandboxRow, dict[str, str]], None]] = []
        self.ksm = ksm.Ksm(settings)  # the ksm policy; start() sets the host's ksmd up for it

    # ---- lifecycle of the orchestrator itself ---------------------------------------------------
    def attach_repository(self, repository: Any) -> None:
        """Publish snapshots to ``repository`` and fetch from it (``sync.py``). Before ``start``."""
        self.sync.attach_repository(repository)

    async def start(self) -> None:
        self.settings.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(self.ksm.start)
        await self.runtime.start()
        await self.volumes.start()  # on the sandboxes volume, which the runtime's start mounts
        await recover(self.ctx)
        self.snapshots.discard_unfinished()
        if self.ctx.repository is not None:
            self.sync.resume_publishing()
        self.template_flows.start()
        await self.builds.start()
        self._tasks.append(asyncio.create_task(self._reaper(), name="aenv-reaper"))
        self._tasks.append(asyncio.create_task(self._sampler(), name="aenv-sampler"))

    async def close(self) -> None:
        if self.settings.stop_sandboxes_on_exit:  # a throwaway server takes every sandbox with it
            report = await self.kill_matching({}, KILLED, "the server stopped (stop_sandboxes_on_exit)")
            for sandbox_id, why in report.failed:  # (each one killed is logged by kill())
                log.warning("stop_sandboxes_on_exit: sandbox=%s not killed: %s", sandbox_id, why)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        self._tasks.clear()
        await self.snapshots.aclose()
        await self.sync.aclose()
        await self.builds.aclose()
        await self.template_flows.aclose()
        await self.runtime.close()
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.ksm.close)

    async def update_network(self, sandbox_id: str, req: net.NetworkRequest, allow_internet: bool | None) -> None:
        """``PUT /sandboxes/{id}/network``: replace the sandbox's egress rules, live (``network.update``);
        the rules' secrets are its team's."""
        sbx = self.get(sandbox_id)
        await net.update(self.runtime, self.store, sbx, req, allow_internet, self.secrets.binder(sbx.row.owner))

    # ---- queries --------------------------------------------------------------------------------
    def get(self, sandbox_id: str) -> LiveSandbox:
        return self.table.get(sandbox_id)

    def list_sandboxes(self, query: ListQuery) -> tuple[list[LiveSandbox], str | None]:
        items = [
            s
            for s in self.table
            if s.state.shown in query.states
            and all(s.row.metadata.get(k) == v for k, v in query.metadata.items())
            and (query.template is None or query.template in (s.row.template_id, s.row.alias))
            and (query.started_after is None or _usec(s.row.started_at) >= _usec(query.started_after))
            and (query.owner is None or s.row.owner == query.owner)
        ]
        items.sort(key=lambda s: (s.row.started_at, s.row.created_seq), reverse=query.descending)
        if query.after:
            ids = [s.id for s in items]
            if query.after in ids:
                items = items[ids.index(query.after) + 1 :]
        page = items[: query.limit]
        next_token = page[-1].id if len(items) > query.limit and page else None
        return page, next_token

    def find_by_file_signature(
        self, path: str, op: str, user: str, signature: str, expiration: str | None
    ) -> str | None:
        """The running sandbox whose envd token signed this /files URL (spec §3.2), if any."""
        for sbx in self.table:
            token = sbx.row.access_token
            if token and sbx.state is SandboxState.RUNNING and hmac.compare_digest(
                file_signature(path, op, user, token, expiration), signature
            ):
                return sbx.id
        return None

    def template_ids_in_use(self) -> set[str]:
        return self.table.template_ids_in_use()

    # ---- sandbox actions ------------------------------------------------------------------------

    async def create(self, req: CreateRequest) -> LiveSandbox:
        if req.idempotency_key:
            existing = self._idempotency.get(req.idempotency_key)
            if existing is not None:
                return await asyncio.shield(existing)
            row = self.store.find_by_idempotency_key(req.idempotency_key)
            found = self.table.find(row.id) if row is not None else None
            if found is not None:
                return found
            fut: asyncio.Future[LiveSandbox] = asyncio.get_running_loop().create_future()
            self._idempotency[req.idempotency_key] = fut
            try:
                sbx = await self._create(req)
                fut.set_result(sbx)
                return sbx
            except BaseException as exc:
                fut.set_exception(exc)
                fut.exception()
                raise
            finally:
                self._idempotency.pop(req.idempotency_key, None)
        return await self._create(req)

    async def _create(self, req: CreateRequest) -> LiveSandbox:
        timeout = req.timeout if req.timeout is not None else self.settings.default_timeout
        self.ctx.check_timeout(timeout)
        template = await self.sync.resolve_template(req.template)  # may fetch a snapshot from the repository
        if not (req.admin or template.public or template.owner in ("", req.owner)):
            raise TemplateNotFound(req.template)  # another team's private template: as if there were none
        cpus, memory = req.cpu_count or template.cpu_count, req.memory_mb or template.memory_mb
        # A burst waits its turn here (fairly per team, then run), or is a readable 429 (admission.py).
        async with self.admission.slot(req.owner, req.metadata.get(self.settings.admission_group_key), cpus, memory):
            # checked and taken with no await before table.add: two creates cannot both write a volume
            mounts = self.volumes.resolve(req.owner, list(req.volume_mounts))
            sandbox_id = new_id()
            started = now()
            row = SandboxRow(
                id=sandbox_id,
                template_id=template.id,
                alias=template.alias,
                state=SandboxState.STARTING,
                runtime=self.runtime.name,
                started_at=started,
                end_at=started + timeout,
                cpu_count=cpus,
                memory_mb=memory,
                disk_mb=template.disk_mb,
                auto_pause=req.auto_pause,
                auto_pause_memory=req.auto_pause_memory,
                auto_resume=req.auto_resume,
                **net.row_fields(req.network, req.allow_internet, self.secrets.binder(req.owner),
                                 bandwidth.record(req.bandwidth, self.settings)),
                metadata=dict(req.metadata),
                env_vars={**mirrors.env_for(self.settings), **req.env_vars},
                access_token=new_token() if req.secure else None,
                idempotency_key=req.idempotency_key,
                created_seq=self.table.next_seq(),
                volume_mounts=mounts,
                owner=req.owner,
            )
            snapshot = self.snapshots.snapshot_for_template(template.id) if template.kind is TemplateKind.SNAPSHOT else None
            if snapshot is not None:
                row.lineage_head = snapshot.id
                row.depends_on = [snapshot.id]
            spec = self.ctx.spec_for(row, template)  # the row just resolved: no second lookup
            if self.admission.in_burst(req.owner):
                spec = replace(spec, in_burst=True)
            sbx = LiveSandbox(row=row, spec=spec)
            self.admission.check_quota(req.owner, 1, cpus, memory)  # again: others may have been added meanwhile
            self.store.put_sandbox(row)  # first: in cluster mode a fenced node refuses here, holding nothing
            self.table.add(sbx)
            try:
                fault_point("create.stored")
                await net.enforce(self.runtime, row)  # before the sandbox has a network namespace
                await self.template_flows.ready_to_start(template)
                if snapshot is not None:
                    state = await self.snapshots.runtime.create_from_snapshot(spec, Path(snapshot.dir), result_of(snapshot))
                else:
                    state = await self.runtime.create(spec)
                await mirrors.write_apt_sources(self.settings, self.runtime, sandbox_id, row.access_token)
                await mirrors.write_docker_mirror(self.settings, self.runtime, sandbox_id, row.access_token,
                                                  spec.template.nested_containers)
            except BaseException:
                await self.ctx.forget(row)
                raise
            fault_point("create.started")
            self.template_flows.note_started(template)  # a lazy image's first start: its prefetch list
            # The TTL counts from when the sandbox became usable.
            row.started_at = now()
            row.end_at = row.started_at + timeout
            row.state = SandboxState.RUNNING
            row.runtime_state = state.data
            self.store.update_sandbox(
                sandbox_id, state=row.state, started_at=row.started_at, end_at=row.end_at, runtime_state=state.data
            )
            log.info("sandbox=%s created template=%s runtime=%s", sandbox_id, template.id, self.runtime.name)
            self._notify_running(sandbox_id)
            self._emit("created", row)
            return sbx

    async def kill(self, sandbox_id: str, reason: str = KILLED, detail: str = "killed through the API") -> None:
        """End a sandbox; a later request about it hears ``reason`` (``store/gone_log.py``)."""
        sbx = self.get(sandbox_id)
        async with sbx.lock:
            if sbx.id not in self.table:
                raise self.table.not_found(sandbox_id)
            sbx.row.state = SandboxState.KILLING
            self.store.update_sandbox(sbx.id, state=sbx.row.state)
            fault_point("kill.stored")
            await self.ctx.forget(sbx.row, reason, detail)
        self.snapshots.collect_garbage()
        log.info("sandbox=%s killed", sandbox_id)
        self._emit("killed", sbx.row, reason=reason, detail=detail)

    async def kill_matching(self, metadata: dict[str, str], reason: str = REAPED, detail: str | None = None,
                            owner: str | None = None) -> KillReport:
        """Kill every sandbox tagged with all of ``metadata`` (of team ``owner`` only, unless None), even one
        still starting (``fleet.py``)."""
        why = detail or "killed by metadata " + ", ".join(f"{k}={v}" for k, v in sorted(metadata.items()))

        async def reap(sandbox_id: str) -> None:
            await self.kill(sandbox_id, reason, why)

        return await kill_matching(self.table, reap, metadata, owner)

    async def set_timeout(self, sandbox_id: str, timeout: int) -> None:
        """``endAt = now + timeout``; 0 expires the sandbox now (killed, or paused with autoPause)."""
        if timeout != 0:
            self.ctx.check_timeout(timeout)
        sbx = self.get(sandbox_id)
        async with sbx.lock:
            require_state(sbx.id, sbx.state, SandboxState.RUNNING, action="set the timeout of")
            sbx.row.end_at = now() + timeout
            self.store.update_sandbox(sbx.id, end_at=sbx.row.end_at)
        if timeout == 0:
            await self._expire(sbx, sbx.row.end_at)

    async def pause(self, sandbox_id: str, keep_memory: bool = True, require_healthy_guest: bool = False) -> None:
        """Pause keeping memory, or (``keep_memory=False``) the files only. A files-only pause, and any
        with ``require_healthy_guest``, first needs envd to answer (GuestUnresponsive: it runs on)."""
        sbx = self.get(sandbox_id)
        async with sbx.lock:
            require_state(sbx.id, sbx.state, SandboxState.RUNNING, action="pause")
            if require_healthy_guest or not keep_memory:
                await self.ctx.check_guest(sbx.id)
            await self._pause_locked(sbx, keep_memory)

    async def _pause_locked(self, sbx: LiveSandbox, keep_memory: bool = True) -> None:
        await pausing.pause_locked(self.ctx, sbx, keep_memory)
        self._emit("paused", sbx.row)

    async def connect(self, sandbox_id: str, timeout: int | None, keep_memory: bool = True,
                      auto_pause: bool | None = None) -> tuple[LiveSandbox, bool]:
        """E2B connect: extend a running sandbox's TTL, or resume a paused one (``keep_memory=False``:
        as a cold start on its files). ``auto_pause`` (the old resume route) sets its expiry action.
        Returns (sandbox, resumed)."""
        timeout = timeout if timeout is not None else self.settings.default_timeout
        self.ctx.check_timeout(timeout)
        sbx = self.get(sandbox_id)
        async with sbx.lock:
            if sbx.id not in self.table:
                raise self.table.not_found(sandbox_id)
            if sbx.state is SandboxState.RUNNING:
                sbx.row.end_at = max(sbx.row.end_at, now() + timeout)
                self.store.update_sandbox(sbx.id, end_at=sbx.row.end_at)
                return sbx, False
            require_state(sbx.id, sbx.state, SandboxState.PAUSED, action="resume")
            if auto_pause is not None:
                sbx.row.auto_pause = auto_pause
                self.store.update_sandbox(sbx.id, auto_pause=auto_pause)
            await self._resume_locked(sbx, timeout, keep_memory)
            return sbx, True

    async def _resume_locked(self, sbx: LiveSandbox, timeout: int, keep_memory: bool = True) -> None:
        await pausing.resume_locked(self.ctx, sbx, timeout, keep_memory)
        self._notify_running(sbx.id)
        self._emit("resumed", sbx.row)

    def _notify_running(self, sandbox_id: str) -> None:
        for hook in self.on_running:
            try:
                hook(sandbox_id)
            except Exception:  # noqa: BLE001 - a hook is an optimisation, never a reason to fail
                log.exception("sandbox=%s on_running hook failed", sandbox_id)

    def _emit(self, event: str, row: SandboxRow, **extra: str) -> None:
        for hook in self.on_event:
            try:
                hook(event, row, extra)
            except Exception:  # noqa: BLE001 - an event hook never fails the lifecycle step it reports
                log.exception("sandbox=%s on_event hook failed (%s)", row.id, event)

    async def open_stream(self, sandbox_id: str, port: int) -> ByteStream:
        """A byte stream into the sandbox for the proxy. Paused sandboxes resume first when autoResume is on."""
        sbx = self.table.find(sandbox_id)
        if sbx is None or not sbx.state.visible:
            raise self.table.not_found(sandbox_id)
        if sbx.state is not SandboxState.RUNNING:
            # autoResume wakes a sandbox where it stopped; one that kept only its files is resumed
            # (cold) by an explicit connect alone, as in E2B.
            if not sbx.row.auto_resume or sbx.row.pause_mode is SnapshotMode.FILESYSTEM:
                raise self.table.not_found(sandbox_id)
            async with sbx.lock:
                if sbx.state is SandboxState.PAUSED:
                    await self._resume_locked(sbx, self.settings.default_timeout)
        try:
            return await self.runtime.open_stream(sandbox_id, port)
        except AenvError:
            raise
        except StreamRefused as exc:
            raise PortNotOpen(f"sandbox '{sandbox_id}': nothing listens on port {port}: {exc}") from exc
        except Exception as exc:
            raise SandboxUnreachable(f"sandbox '{sandbox_id}' did not answer on port {port}: {exc}") from exc

    async def metrics(self, sandbox_id: str, start: float | None, end: float | None) -> list[ResourceSample]:
        sbx = self.get(sandbox_id)
        if sbx.state is SandboxState.RUNNING:
            with contextlib.suppress(Exception):
                sample = await self.runtime.metrics(sbx.id)
                last = sbx.samples.last_timestamp()
                if last is None or sample.timestamp - last >= 1.0:
                    sbx.samples.append(sample)
        return sbx.samples.between(start if start is not None else 0.0, end if end is not None else float("inf"))

    # ---- background work ------------------------------------------------------------------------
    async def _reaper(self) -> None:
        rounds = 0
        while True:
            await asyncio.sleep(self.settings.reaper_interval)
            await self.reap_expired(now())
            rounds += 1
            if rounds % 600 == 1:  # now and then: tombstones past their retention
                self.gone.prune(now() - self.settings.gone_retention)

    async def reap_expired(self, at: float) -> list[str]:
        """One reaper round at time ``at``: running sandboxes past their end are paused (autoPause) or
        killed. Returns their IDs. The loop passes the wall clock; tests pass any time they like."""
        reaped: list[str] = []
        for sbx in self.table:
            if sbx.state is not SandboxState.RUNNING or sbx.row.end_at > at:
                continue
            try:
                if await self._expire(sbx, at):
                    reaped.append(sbx.id)
            except AenvError as exc:
                log.warning("sandbox=%s reaper: %s", sbx.id, exc)
            except Exception:
                log.exception("sandbox=%s reaper failed", sbx.id)
        return reaped

    async def _expire(self, sbx: LiveSandbox, at: float) -> bool:
        """The expiry of a sandbox whose end is ``at`` or earlier: paused (autoPause, keeping memory
        unless autoPauseMemory is false) or killed. False if it changed meanwhile."""
        if not sbx.row.auto_pause:
            log.info("sandbox=%s expired; killing", sbx.id)
            await self.kill(sbx.id, EXPIRED, "its timeout ran out")
            return True
        async with sbx.lock:
            if sbx.state is not SandboxState.RUNNING or sbx.row.end_at > at:
                return False
            await self._pause_locked(sbx, await pausing.expiry_keeps_memory(self.ctx, sbx))
            return True

    async def _sampler(self) -> None:
        while True:
            await asyncio.sleep(METRICS_INTERVAL)
            running = [sbx.id for sbx in self.table if sbx.state is SandboxState.RUNNING]
            with contextlib.suppress(Exception):  # ksmd scans while memory is short, rests once merging settled
                await asyncio.to_thread(self.ksm.adjust, None, running)
            with contextlib.suppress(Exception):
                for sandbox_id, sample in (await self._sample_all(running)).items():
                    if (sbx := self.table.find(sandbox_id)) is not None:
                        sbx.samples.append(sample)

    async def _sample_all(self, running: list[str]) -> dict[str, ResourceSample]:
        if isinstance(self.runtime, BatchSampling):
            return await self.runtime.metrics_many(running)
        out: dict[str, ResourceSample] = {}
        for sandbox_id in running:
            with contextlib.suppress(Exception):
                out[sandbox_id] = await self.runtime.metrics(sandbox_id)
        return out

    def stats(self) -> dict[str, Any]:
        return {"sandboxes": self.table.counts_by_state(), "starting": self.admission.starting, "waiting":
                self.admission.waiting, "runtime": self.runtime.name, **placement_facts(self.runtime, self.ctx.templates)}

    def capabilities(self) -> dict[str, Any]:
        return {**self.runtime.capabilities(), **self.template_flows.builder.lazy.describe()}

    # ---- checkpoints: snapshots.py --------------------------------------------------------------
    async def snapshot(self, sandbox_id: str, name: str | None, mode: str) -> SnapshotRow:
        await self.check_disk(self.get(sandbox_id).row.owner)
        return await self.snapshots.create(sandbox_id, name, mode)

    async def check_disk(self, owner: str) -> None:
        """Refuse a team that keeps its whole ``max_disk_mb`` already (``team_disk.py``)."""
        await team_disk.check_disk(self.admission, self.store, self.volumes, owner)

    async def fork(self, sandbox_id: str, count: int, timeout: int | None) -> list[LiveSandbox | AenvError]:
        out = await self.snapshots.fork(sandbox_id, count, timeout)
        for child in out:
            if isinstance(child, LiveSandbox):
                self._emit("forked", child.row, parentSandboxId=sandbox_id)
        return out

    async def rollback(self, sandbox_id: str, snapshot_id: str) -> LiveSandbox:
        return await self.snapshots.rollback(sandbox_id, snapshot_id)

    def get_snapshot(self, id_or_name: str) -> SnapshotRow:
        return self.snapshots.get(id_or_name)

    def find_snapshot(self, snapshot_id: str) -> SnapshotRow | None:
        """Any snapshot row (internal fork points included), or None."""
        return self.store.get_snapshot(snapshot_id)

    def list_snapshots(self, sandbox_id: str | None = None, name: str | None = None) -> list[SnapshotRow]:
        return self.snapshots.list_snapshots(sandbox_id=sandbox_id, name=name)

    def snapshot_tree(self, snapshot_id: str) -> dict[str, Any]:
        """Where a snapshot sits: its children, its lineage (itself first), the sandboxes using it."""
        return {
            "children": self.snapshots.children(snapshot_id),
            "lineage": [r.id for r in self.snapshots.lineage(snapshot_id)],
            "usedBy": self.snapshots.dependents(snapshot_id),
        }

    def snapshot_result(self, row: SnapshotRow) -> SnapshotResult:
        """What the runtime recorded about a snapshot (mode, layers, how long the sandbox stopped)."""
        return result_of(row)

    def snapshot_writing(self, snapshot_id: str) -> bool:
        return self.snapshots.is_writing(snapshot_id)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self.snapshots.delete(snapshot_id)

    # ---- templates: template_flows.py -----------------------------------------------------------
    def ensure_base_template(self) -> None:
        self.template_flows.ensure_base()

    def list_templates(self) -> list[TemplateRow]:
        """What users named or pulled; a build's bases and steps (``config.hidden``) stay out."""
        return [t for t in self.templates.list_templates() if not t.config.get("hidden")]

    def get_template(self, name: str) -> TemplateRow:
        return self.templates.resolve(name)

    async def pull_template(self, image: str, *, progress: ProgressCallback | None = None,
                            **options: Any) -> tuple[TemplateRow, str]:
        await self.check_disk(str(options.get("owner", "")))
        return await self.template_flows.pull(image, progress=progress, **options)

    async def delete_template(self, name: str) -> None:
        """A snapshot template deletes its snapshot; an image template drains the runtime's pools; a
        built template leaves the shared store too (``template_share.py``)."""
        await self.shared_templates.delete(name)

    def cache_listing(self) -> dict[str, Any]:
        return self.template_flows.cache_listing()

    async def prune_cache(self, everything_unpinned: bool) -> dict[str, Any]:
        return await self.template_flows.prune_cache(everything_unpinned)

    async def pin_cache(self, template: str, pinned: bool) -> dict[str, Any]:
        return await self.template_flows.pin_lazy(self.templates.resolve(template), pinned)

"""What every core flow shares: the long-lived parts, and the few steps all of them take.

Lifecycle (``orchestrator.py``), checkpoints (``snapshots.py``), the snapshot repository
(``sync.py``) and templates (``template_flows.py``) each get one ``Context`` instead of reaching into
each other: the dependency points one way, and no flow mutates another's private state.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from dataclasses import dataclass
from typing import Any

from aenv.config import Settings
from aenv.core.table import SandboxTable
from aenv.core.templates import TemplateCatalog
from aenv.core.uid_slots import UidRanges
from aenv.core.volumes import Volumes
from aenv.errors import GuestUnresponsive, InvalidRequest
from aenv.faults import fault_point
from aenv.runtime.base import Runtime, RuntimeState, SandboxSpec
from aenv.runtime.envd_client import ENVD_PORT, request
from aenv.store.gone_log import GoneLog
from aenv.store.sqlite import SandboxRow, Store, TemplateRow, now

GUEST_CHECK_TIMEOUT = 10.0  # s for envd to answer /health when a pause needs its answer


@dataclass
class Context:
    settings: Settings
    store: Store
    runtime: Runtime
    templates: TemplateCatalog
    table: SandboxTable
    repository: Any = None  # aenv.snapshots.SnapshotRepository once attached (sync.py), else None
    gone: GoneLog | None = None  # tombstones of ended sandboxes (the orchestrator's), else none kept
    volumes: Volumes | None = None  # E2B volumes (the orchestrator's): what a row's volume_mounts bind
    uid_ranges: UidRanges | None = None  # the ns uid range of a row's team (the orchestrator's), else slot 0

    def check_timeout(self, timeout: int) -> None:
        if timeout <= 0:
            raise InvalidRequest("Timeout must be greater than 0")
        if timeout > self.settings.max_timeout:
            hours = self.settings.max_timeout / 3600
            raise InvalidRequest(f"Timeout cannot be greater than {hours:g} hours")

    async def check_guest(self, sandbox_id: str) -> None:
        """envd in the running sandbox answers ``/health``, else GuestUnresponsive (nothing changes)."""
        try:
            async with asyncio.timeout(GUEST_CHECK_TIMEOUT):
                status, _ = await request(await self.runtime.open_stream(sandbox_id, ENVD_PORT), "GET", "/health")
        except Exception as exc:  # noqa: BLE001 - whatever stopped the answer, the guest did not give it
            raise GuestUnresponsive(f"sandbox '{sandbox_id}': envd did not answer ({exc!r}); it keeps running",
                                    sandbox_id=sandbox_id) from exc
        if not 200 <= status < 300:
            raise GuestUnresponsive(f"sandbox '{sandbox_id}': envd answered {status}; it keeps running",
                                    sandbox_id=sandbox_id)

    def spec_for(self, row: SandboxRow, template: TemplateRow | None = None) -> SandboxSpec:
        """What the runtime needs to (re)create the sandbox of ``row``."""
        if template is None or template.id != row.template_id:
            template = self.templates.resolve(row.template_id)
        return SandboxSpec(
            sandbox_id=row.id,
            template=self.templates.image(template),
            workdir=self.settings.sandboxes_dir / row.id,
            cpu_count=row.cpu_count,
            memory_mb=row.memory_mb,
            disk_mb=row.disk_mb,
            pids_limit=self.settings.pids_limit,
            # whether it was made with a way out (a row from before store v4: network.needs_internet)
            allow_internet=row.has_network if row.has_network is not None else (
                row.allow_internet or bool(row.network.get("allowOut"))),
            env_vars=dict(row.env_vars),
            access_token=row.access_token,
            volumes=self.volumes.binds(row) if self.volumes is not None else (),
            uid_slot=self.uid_ranges.slot(row.owner) if self.uid_ranges is not None else 0,
        )

    async def forget(self, row: SandboxRow, reason: str | None = None, detail: str = "") -> None:
        """End a sandbox for good: its tombstone (with ``reason``: one a client saw), the runtime's side,
        its directory, then its row (in that order, so a crash in between leaves a row that recovery
        cleans up again, and the first reason stays the one a late request hears)."""
        if reason is not None and self.gone is not None:
            self.gone.record(row.id, reason, detail, now(), row.owner)
        self.table.discard(row.id)
        with contextlib.suppress(Exception):
            await self.runtime.kill(row.id, RuntimeState(row.runtime_state))
        fault_point("kill.done")
        shutil.rmtree(self.settings.sandboxes_dir / row.id, ignore_errors=True)
        self.store.delete_sandbox(row.id)

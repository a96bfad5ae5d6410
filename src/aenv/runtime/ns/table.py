"""Which ns sandboxes exist: the live-sandbox table of one ``NsRuntime``, shared with its parts.

A sandbox is *running* (an ``NsSandbox``: running or frozen by a pause), *stopped* (paused without
memory: no process, its recorded state kept here and in its ``ns.json``) or released to disk
(``release.py`` keeps those). Beside them: the spec each was created with. The runtime and the parts
(``lifecycle.py``, ``snapshot.py``, ``release.py``, ``restored.py``) all read and write this one
object, which is what lets them work on the same sandboxes without importing ``runtime.py``; the
vm runtime's twin is ``vm/table.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from aenv.errors import SandboxNotFound
from aenv.runtime.base import RuntimeState, SandboxSpec

if TYPE_CHECKING:
    from aenv.runtime.ns.sandbox import NsSandbox


class NsTable:
    """The running and stopped sandboxes and their specs (a released one has its spec here too)."""

    def __init__(self) -> None:
        self.running: dict[str, NsSandbox] = {}
        self.specs: dict[str, SandboxSpec] = {}
        self.stopped: dict[str, dict[str, Any]] = {}  # paused without memory: its recorded state

    def get(self, sandbox_id: str) -> NsSandbox:
        """The running sandbox, else SandboxNotFound (a stopped or released one is not running)."""
        sbx = self.running.get(sandbox_id)
        if sbx is None:
            raise SandboxNotFound(sandbox_id)
        return sbx

    def add(self, sandbox_id: str, sbx: NsSandbox, spec: SandboxSpec) -> None:
        self.running[sandbox_id] = sbx
        self.specs[sandbox_id] = spec

    def workdir(self, sandbox_id: str, state: RuntimeState | None = None) -> Path | None:
        """The sandbox's workdir: its spec's, else the one its recorded ``state`` names."""
        spec = self.specs.get(sandbox_id)
        if spec is not None:
            return spec.workdir
        raw = state.data.get("workdir") if state else None
        return Path(raw) if raw else None

    @staticmethod
    def state(sbx: NsSandbox, workdir: Path | None) -> RuntimeState:
        """What the store records of a running sandbox (``ns.json``'s fields and its workdir)."""
        data = sbx.state()
        data["workdir"] = str(workdir) if workdir else None
        return RuntimeState(data=data)

    def volume_points(self, sbx: NsSandbox) -> list[str]:
        """Where ``sbx``'s E2B volumes are mounted: external mounts of its CRIU dumps (``criu.py``)."""
        spec = self.specs.get(sbx.name)
        volumes = spec.volumes if spec is not None else sbx.opts.volumes if sbx.opts is not None else ()
        return [v.path for v in volumes]

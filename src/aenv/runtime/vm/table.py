"""Which vm sandboxes exist: the live-sandbox table of one ``VmRuntime``.

A sandbox is in one of two forms here: *running* (a :class:`~.sandbox.VmSandbox`: a QEMU process,
running or paused in RAM) or *released* (a :class:`Released`: paused, saved to disk, its QEMU
ended; ``release.py`` moves it between the two). A released one without memory (``memory=False``)
is *stopped*: only its disk was kept (a files-only pause), and it comes back by a cold boot
(``coldboot.py``). Beside them: the spec each was created with and
one lock per sandbox, which pause, resume, release, snapshot and kill take so that a release to
disk never runs in the middle of another of them. Everything else (pools, templates, snapshot
files being written) is not a sandbox and lives elsewhere.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aenv.errors import SandboxNotFound
from aenv.runtime.base import RuntimeState, SandboxSpec

from .sandbox import VmSandbox

RELEASED_STATE = "released.full"  # in a run dir: a paused sandbox saved to disk, its QEMU ended
# A released VM on a frozen base RAM is saved layered instead: device state, changed pages, a link
# of the base RAM image, and last this marker (JSON: which base RAM), whose presence means released.
RELEASED_LAYERED = "released.json"
RELEASED_FILES = ("released.devices", "released.layer", "released.base")
# A stopped sandbox (paused keeping its files only): its disk overlays stay, and this marker (JSON:
# which overlay is on top) says so; it comes back by booting on that disk.
STOPPED_MARKER = "stopped.json"


@dataclass(frozen=True)
class Released:
    """A paused sandbox whose VM was saved into ``run_dir`` (``released.full``, or layered files and
    ``released.json``) and ended: no process, no RAM; its disk overlays stay in ``run_dir``.
    ``resume`` restores it into a new QEMU."""

    name: str
    run_dir: Path
    template_key: str
    disk_generation: int
    allow_internet: bool
    memory: bool = True  # False: stopped, only the disk kept

    @property
    def state_file(self) -> Path:
        return self.run_dir / RELEASED_STATE

    @property
    def marker(self) -> Path:
        return self.run_dir / RELEASED_LAYERED

    @property
    def stopped_marker(self) -> Path:
        return self.run_dir / STOPPED_MARKER

    def files(self) -> list[Path]:
        """The saved memory state (none for a stopped one: its marker stays until it boots)."""
        return [self.state_file, self.marker, *(self.run_dir / n for n in RELEASED_FILES)]

    def state(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "run_dir": str(self.run_dir),
            "template_key": self.template_key,
            "released": str(self.state_file),
            "disk_generation": self.disk_generation,
            "stopped": not self.memory,
        }


class VmTable:
    def __init__(self) -> None:
        self.running: dict[str, VmSandbox] = {}
        self.released: dict[str, Released] = {}
        self.specs: dict[str, SandboxSpec] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def get(self, sandbox_id: str) -> VmSandbox:
        """The running sandbox, else SandboxNotFound (a released one is not running)."""
        sbx = self.running.get(sandbox_id)
        if sbx is None:
            raise SandboxNotFound(sandbox_id)
        return sbx

    def lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    def add(self, sandbox_id: str, sbx: VmSandbox, spec: SandboxSpec) -> None:
        self.running[sandbox_id] = sbx
        self.specs[sandbox_id] = spec

    def remove(
        self, sandbox_id: str, *, drop_lock: bool = False
    ) -> tuple[VmSandbox | None, Released | None, SandboxSpec | None]:
        """Forget the sandbox in any form (kill; rollback, which keeps its lock); returns what there
        was to end."""
        if drop_lock:
            self._locks.pop(sandbox_id, None)
        return (self.running.pop(sandbox_id, None), self.released.pop(sandbox_id, None),
                self.specs.pop(sandbox_id, None))

    def run_dir_names(self) -> set[str]:
        """The run dirs (under the run root) that belong to sandboxes of this table."""
        return {s.run_dir.name for s in self.running.values()} | {r.run_dir.name for r in self.released.values()}

    def state(self, sbx: VmSandbox, spec: SandboxSpec | None) -> RuntimeState:
        data = sbx.state()
        data["workdir"] = str(spec.workdir) if spec else None
        return RuntimeState(data=data)

    def state_of(self, sandbox_id: str) -> RuntimeState:
        """The state to record for a sandbox in whichever form it is."""
        spec = self.specs.get(sandbox_id)
        rel = self.released.get(sandbox_id)
        if rel is None:
            return self.state(self.get(sandbox_id), spec)
        data = rel.state()
        data["workdir"] = str(spec.workdir) if spec else None
        return RuntimeState(data=data)

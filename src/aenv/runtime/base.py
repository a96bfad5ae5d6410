"""The Runtime protocol: what the orchestrator needs from a sandbox technology (ns or vm).

A runtime knows processes, mounts, files and sockets; it knows nothing about HTTP or the E2B API.
The orchestrator (``aenv.core``) is its only caller and owns all bookkeeping in the store; a runtime
keeps just enough on disk (under ``SandboxSpec.workdir``) to re-adopt or clean up after a crash.

Lifecycle seen by a runtime::

    create(spec) ──> running ──pause()──> paused ──resume()──> running
        │                                                      │
        └──────────────────── kill() (any state) ──────────────┘

A pause keeps memory (processes continue on resume) unless ``keep_memory=False``: then every
process ends and only the files stay ("stopped"); its resume, and any ``resume(keep_memory=False)``,
is a cold start on those files: new processes, a new boot id.

Every method is idempotent where that makes sense: ``kill`` of a dead sandbox returns quietly,
``close`` twice is a no-op.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from aenv.kinds import SnapshotMode
from aenv.mux.stream import ByteStream
from aenv.runtime.netpolicy import EgressPolicy
from aenv.runtime.shaping import Bandwidth
from aenv.snapshots.record import normalize


@dataclass(frozen=True)
class SandboxImage:
    """What a runtime needs to start a sandbox from a template."""

    template_id: str
    rootfs: Path  # unpacked root filesystem directory (ns: overlay lower; vm: source of the ext4 base)
    lowers: tuple[Path, ...] = ()  # the complete overlay lowerdir list, top first; empty = (rootfs,)
    env: dict[str, str] = field(default_factory=dict)  # image Env
    workdir: str | None = None  # image WorkingDir
    user: str = "user"  # default user for processes and files
    start_cmd: str | None = None  # started in the background once at sandbox start
    start_user: str | None = None  # ... as this user (None: root) and in this directory (None: /)
    start_cwd: str | None = None
    ready_cmd: str | None = None
    # A lazy image (images/lazy): its read-only ext4 as a file served on demand. vm: the raw backing of
    # the template disk instead of an ext4 made from ``rootfs``; ns: ``lowers`` already name its mount.
    lazy_file: Path | None = None
    # Docker inside (the ``docker`` template, issue 40): ns gives the sandbox what dockerd needs in its
    # own namespaces (capabilities of its user namespace, sysfs, writable net sysctls); vm boots it as is.
    nested_containers: bool = False


@dataclass(frozen=True)
class VolumeBind:
    """A volume's directory on the host, bound at ``path`` inside the sandbox (E2B ``volumeMounts``)."""

    source: Path
    path: str  # absolute, normalised, not ``/`` (checked at the API edge)
    read_only: bool = False


@dataclass(frozen=True)
class SandboxSpec:
    """Everything a runtime needs to create one sandbox. Immutable; the orchestrator builds it."""

    sandbox_id: str
    template: SandboxImage
    workdir: Path  # the sandbox's own directory under the state dir; the runtime may put anything in it
    cpu_count: int = 2
    memory_mb: int = 512
    disk_mb: int = 2048
    pids_limit: int = 4096
    allow_internet: bool = True
    env_vars: dict[str, str] = field(default_factory=dict)  # sandbox-wide env (E2B envVars)
    access_token: str | None = None  # envd X-Access-Token, None = no envd auth
    volumes: tuple[VolumeBind, ...] = ()  # persistent volumes bound into the sandbox (VolumeCapable)
    # One of a burst of its team's starts while other teams share the server (core/admission.py
    # ``in_burst``): it starts fresh, leaving the few pooled sandboxes to the other teams' creates.
    in_burst: bool = False
    # ns: the host uid range its processes run in (``aenv/uid_ranges.py``; core picks it from the
    # sandbox's team: 0 = ``ns_userns_uid`` itself, the shared range). vm ignores it.
    uid_slot: int = 0


@dataclass(frozen=True)
class SnapshotResult:
    """What a runtime wrote into a snapshot directory, and in which mode it really did it.

    ``mode`` is full (processes + memory + files) or filesystem (files only); a runtime never reports
    more than it did, and the orchestrator refuses a request it cannot honour. The typed fields are
    what core and the repository read; ``data`` is the runtime's own and opaque to everyone else.
    Stored as a record (``snapshots/record.py`` names the keys): :meth:`to_record`, :meth:`from_record`.
    """

    mode: SnapshotMode
    layers: tuple[str, ...] = ()  # paths inside the snapshot dir that the repository stores
    stack: tuple[str, ...] = ()  # host paths of other snapshots' layers it sits on, top first
    base_lowers: tuple[str, ...] = ()  # host paths of the image layers under the stack (ns)
    paused_ms: float | None = None  # how long the sandbox was stopped to take it
    parent_snapshot: str | None = None
    data: dict[str, Any] = field(default_factory=dict)
    # Files the runtime is still writing after the call returned (the sandbox already runs on):
    # awaiting it raises if they could not be written. ``data`` may gain entries until then. The
    # runtime's own restores wait for it; the orchestrator waits before sizing or publishing.
    pending: asyncio.Future[None] | None = field(default=None, compare=False, repr=False)

    @property
    def depth(self) -> int:
        """How many snapshot layers it stacks on."""
        return len(self.stack)

    def to_record(self) -> dict[str, Any]:
        return {
            "layers": list(self.layers), "stack": list(self.stack), "base_lowers": list(self.base_lowers),
            "paused_ms": self.paused_ms, "data": self.data,
        }  # fmt: skip

    @classmethod
    def from_record(cls, mode: str, record: dict[str, Any] | None, parent: str | None = None) -> SnapshotResult:
        r = normalize(record)
        paused = r["paused_ms"]
        return cls(
            mode=SnapshotMode(mode), layers=tuple(r["layers"]), stack=tuple(r["stack"]),
            base_lowers=tuple(r["base_lowers"]), paused_ms=float(paused) if paused is not None else None,
            parent_snapshot=parent, data=r["data"],
        )  # fmt: skip


# In a snapshot directory while ``SnapshotResult.pending`` runs: a snapshot that still has it after
# a restart was cut short and is discarded.
UNFINISHED_MARKER = ".unfinished"


@dataclass
class ResourceSample:
    """One metrics sample, in the units E2B's SandboxMetric uses."""

    timestamp: float
    cpu_count: int
    cpu_used_pct: float
    mem_used: int
    mem_total: int
    mem_cache: int
    disk_used: int
    disk_total: int


@dataclass
class RuntimeState:
    """Opaque, JSON-serialisable facts a runtime stores to re-adopt a sandbox after a restart
    (pids, cgroup paths, socket paths). The orchestrator persists it verbatim in the store."""

    data: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Runtime(Protocol):
    """A sandbox technology. Implementations: ``aenv.runtime.ns.NsRuntime``, ``aenv.runtime.vm.VmRuntime``."""

    name: str  # "ns" | "vm"

    async def start(self) -> None:
        """Prepare host resources (cgroup roots, tools bundle, pools). Called once at server start."""

    async def close(self) -> None:
        """Release host resources that are not per-sandbox (pools, background tasks). Sandboxes stay."""

    async def create(self, spec: SandboxSpec) -> RuntimeState:
        """Start a sandbox and return only when envd inside answers ``GET /health`` and has been
        initialised (env vars, access token, identity). Raises RuntimeFailure on any failure, after
        cleaning up everything it started."""

    async def open_stream(self, sandbox_id: str, port: int) -> ByteStream:
        """A fresh byte stream to TCP ``port`` inside the sandbox (49983 = envd).
        Raises SandboxNotFound / SandboxUnreachable."""

    async def pause(self, sandbox_id: str, keep_memory: bool = True) -> RuntimeState:
        """Stop all guest execution at once, keeping memory; ``keep_memory=False``: end every process
        and keep only the files. Returns updated state. Pausing a stopped sandbox again (either way)
        returns its state."""

    async def resume(self, sandbox_id: str, state: RuntimeState, keep_memory: bool = True) -> RuntimeState:
        """Continue a paused sandbox (possibly after a server restart). A stopped one, or any with
        ``keep_memory=False`` (its memory is discarded), cold-starts on its files, initialised like
        ``create``."""

    async def kill(self, sandbox_id: str, state: RuntimeState | None = None) -> None:
        """Remove the sandbox entirely: processes, mounts, cgroups, sockets, its workdir. Idempotent."""

    async def adopt(self, sandbox_id: str, spec: SandboxSpec, state: RuntimeState, stopped: bool = False) -> bool:
        """After a server restart: re-attach to a sandbox left running/paused. False = it is gone
        (the caller then calls kill() to clean leftovers). ``stopped``: the store says it is (or was
        being) paused without memory, or cold-started: whatever of it still runs is ended, its files
        are kept, and it is a stopped sandbox (True while its files are there)."""

    async def metrics(self, sandbox_id: str) -> ResourceSample:
        """A current resource sample (CPU since last sample, memory, disk)."""

    async def forget_template(self, template_id: str) -> None:
        """The template is deleted: end the pooled sandboxes and cached boot state kept for it
        (sandboxes already handed out keep running)."""

    def capabilities(self) -> dict[str, Any]:
        """What this runtime can do here, for ``aenv doctor`` and API responses
        (e.g. {"pause": "freezer", "snapshot": "filesystem", "fork": "filesystem+criu"})."""


@runtime_checkable
class EgressCapable(Protocol):
    """Optional runtime extension: E2B's egress rules (``runtime/egress.py``, ``runtime/netpolicy.py``)."""

    async def set_egress(self, sandbox_id: str, policy: EgressPolicy | None) -> None:
        """Register the sandbox's policy (None or empty: no rules) for every network namespace the
        runtime makes for it from now on, and put it into the one it runs in, if any, at once."""


@runtime_checkable
class BurstYielding(Protocol):
    """Optional runtime extension: a team's burst gives way to another team's creates
    (``core/admission.py``: ``contended``)."""

    def yield_bursts(self, on: bool) -> None:
        """While ``on``, the starts in flight of specs with ``in_burst`` (and those that begin meanwhile)
        run at the lowest CPU weight; off, at the ordinary one. On the event loop: must not block long."""


@runtime_checkable
class BatchSampling(Protocol):
    """Optional runtime extension: the periodic sampler's samples of every running sandbox in one
    thread hop, not two per sandbox (at a thousand sandboxes those hops cost the event loop
    hundreds of milliseconds every cycle)."""

    async def metrics_many(self, sandbox_ids: Sequence[str]) -> dict[str, ResourceSample]:
        """Samples of these sandboxes, as ``metrics`` gives them; one that cannot be sampled now (gone,
        released, between states) is left out."""


@runtime_checkable
class BandwidthCapable(Protocol):
    """Optional runtime extension: per-sandbox bandwidth limits (``runtime/shaping.py``)."""

    async def set_bandwidth(self, sandbox_id: str, bw: Bandwidth | None) -> None:
        """Register the sandbox's own limits (None: the server's default) for every network
        namespace the runtime makes for it from now on; an ``InvalidRequest`` where the host cannot."""


@runtime_checkable
class VolumeCapable(Protocol):
    """Optional runtime extension: it can bind ``SandboxSpec.volumes`` into a sandbox, and it keeps
    volume directories where its sandboxes' disk is counted (ns: a quota subvolume on the sandboxes
    volume). A runtime without it refuses volume mounts; volumes themselves still work."""

    def make_volume_dir(self, path: Path, limit_mb: int) -> None:
        """Create ``path`` (blocking; its parent exists) as an empty directory limited to ``limit_mb``
        where the runtime can limit it; an existing one keeps its contents."""

    def remove_volume_dir(self, path: Path) -> None:
        """Remove a volume directory and everything in it (blocking; idempotent)."""


@runtime_checkable
class SnapshotCapable(Protocol):
    """Optional runtime extension for snapshots, fork and rollback (issue: snapshots/fork).

    A snapshot directory is owned by the orchestrator's snapshot repository; the runtime only writes
    into it (``snapshot``) or reads from it (``create_from_snapshot`` / ``rollback``). Snapshots of a
    sandbox that itself came from a snapshot may reference the parent's layers instead of copying them.
    """

    async def snapshot(self, sandbox_id: str, into: Path, mode: SnapshotMode) -> SnapshotResult:
        """Capture the running sandbox into ``into`` (pausing it only briefly). Raise StateError if the
        requested mode is impossible here."""

    async def fork_mode(self, sandbox_id: str) -> SnapshotMode:
        """The most a snapshot of this sandbox can hold here (fork asks for it: a fork never fails for
        want of memory checkpoints, and reports what it got)."""

    async def create_from_snapshot(self, spec: SandboxSpec, snapshot: Path, result: SnapshotResult) -> RuntimeState:
        """Start a new sandbox (new ID, token, identity) from a snapshot; ready like ``create``. Fork is
        one snapshot then one of these per child, written once in ``core/snapshots.py``."""

    async def rollback(self, sandbox_id: str, spec: SandboxSpec, snapshot: Path, result: SnapshotResult) -> RuntimeState:
        """Put the same sandbox (same ID and token) back to the snapshot's state."""


@runtime_checkable
class MachineBound(Protocol):
    """Optional runtime extension: its saved state restores only on the same machine (vm: accelerator,
    CPU model, QEMU release; ``aenv.machine_key``). Without it, state restores anywhere."""

    def machine(self) -> dict[str, str] | None:
        """This host's machine record (None until known)."""

    def check_restore(self, what: str, result: SnapshotResult) -> None:
        """Raise ``MachineMismatch`` (naming ``what``) when ``result`` records another machine; a
        result without a record passes."""


@runtime_checkable
class WarmReporting(Protocol):
    """Optional runtime extension: how many pre-started sandboxes wait per template (a gateway prefers
    a node where the template is warm)."""

    def warm_counts(self) -> dict[str, int]:
        """Ready pool entries per template ID (templates with none may be left out)."""

"""Shared words with a fixed set of values: a sandbox's lifecycle state, a snapshot's mode, a template's
kind. String enums, so they compare equal to (and store as) their plain values, and every layer (the
store's rows, the runtimes' results, core's guards, the API's JSON) uses the same spelling."""

from __future__ import annotations

import enum


class SandboxState(enum.StrEnum):
    """Lifecycle: starting → running ⇄ paused → killing (then the row is deleted).

    Only ``running`` and ``paused`` are ever shown to E2B clients: a sandbox in a pause or a resume
    shows the state it comes from until it is done (a client polling a pause at expiry must never see
    it vanish), and any call on it waits for the transition under the sandbox's lock.
    """

    STARTING = "starting"
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    RESUMING = "resuming"
    KILLING = "killing"

    @property
    def shown(self) -> SandboxState | None:
        """The state E2B clients see, or None while the sandbox is not theirs (starting, killing)."""
        return _SHOWN.get(self)

    @property
    def visible(self) -> bool:
        return self.shown is not None


_SHOWN = {
    SandboxState.RUNNING: SandboxState.RUNNING,
    SandboxState.PAUSING: SandboxState.RUNNING,
    SandboxState.PAUSED: SandboxState.PAUSED,
    SandboxState.RESUMING: SandboxState.PAUSED,
}


class SnapshotMode(enum.StrEnum):
    FULL = "full"  # processes, memory and files
    FILESYSTEM = "filesystem"  # files only


class TemplateKind(enum.StrEnum):
    BOOTSTRAP = "bootstrap"  # built on this machine (base, code-interpreter-v1)
    IMAGE = "image"  # pulled from an OCI registry
    SNAPSHOT = "snapshot"  # a snapshot, startable by ID or name

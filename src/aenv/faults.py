"""Fault injection for crash-safety tests: die with SIGKILL at a named point, on demand.

Crash safety is only believable if the server is actually killed at the worst moments: after the
store says one thing and before the runtime made it true, or the other way round. ``fault_point``
marks such a moment in the flows; it does nothing unless the ``AENV_FAULTS`` environment variable
arms it, in which case the process SIGKILLs itself there (no ``finally``, no atexit, no flush of
anything but the one log line: exactly what a power cut or the OOM killer would leave behind).

``AENV_FAULTS`` is a comma-separated list of point names, each optionally ``name:N`` to fire on the
Nth time the point is reached (default: the first). Unknown names are accepted silently so a test can
arm a point that a given runtime never reaches. The variable is read once, on first use.

Points are named ``<flow>.<moment>``; ``POINTS`` lists every one with where it sits, so tests can
iterate over them and a reviewer can see the coverage at a glance.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

ENV_VAR = "AENV_FAULTS"

POINTS: dict[str, str] = {
    "create.stored": "create: row written (starting), runtime not yet called",
    "create.started": "create: runtime created the sandbox, store still says starting",
    "pause.stored": "pause: row says pausing, runtime not yet called",
    "pause.done": "pause: runtime paused, store still says pausing",
    "pause.fs.stored": "files-only pause: row says pausing (filesystem), runtime not yet called",
    "pause.fs.done": "files-only pause: runtime ended the processes, store still says pausing",
    "resume.stored": "resume: row says resuming, runtime not yet called",
    "resume.done": "resume: runtime resumed, store still says resuming",
    "resume.cold.stored": "cold resume: row says resuming (filesystem), runtime not yet called",
    "resume.cold.done": "cold resume: runtime started the sandbox anew, store still says resuming",
    "kill.stored": "kill: row says killing, runtime not yet called",
    "kill.done": "kill: runtime killed the sandbox, row and directory still there",
    "snapshot.stored": "snapshot: snapshot row written (creating), runtime not yet called",
    "snapshot.done": "snapshot: runtime wrote the snapshot, row still creating",
    "fork.stored": "fork: child rows and scratch snapshot row written, runtime not yet called",
    "fork.done": "fork: runtime forked, children still starting in the store",
    "pull.layer": "image pull: in the middle of writing a layer blob to the cache",
    "ns.slirp.started": "ns launch: slirp4netns running, its pid not yet in the sandbox's ns.json",
    "ns.release.marked": "ns release to disk: CRIU images and the released marker written, processes not yet ended",
    "ns.release.restored": "ns resume from disk: tree restored and in ns.json, released marker not yet removed",
    "ns.snapshot.linked": "ns full snapshot: one process's pages switched to parent references, the others not yet",
    "publish.layer": "snapshot publish: a layer packed, before it is uploaded to the repository",
}

_lock = threading.Lock()
_armed: dict[str, int] | None = None
_hits: dict[str, int] = {}


def _parse(raw: str) -> dict[str, int]:
    armed: dict[str, int] = {}
    for item in raw.split(","):
        name, _, nth = item.strip().partition(":")
        if not name:
            continue
        try:
            armed[name] = max(1, int(nth)) if nth else 1
        except ValueError:
            armed[name] = 1
    return armed


def armed() -> dict[str, int]:
    """The armed points and the hit on which each fires (parsed once from the environment)."""
    global _armed
    if _armed is None:
        _armed = _parse(os.environ.get(ENV_VAR, ""))
    return _armed


def fault_point(name: str) -> None:
    """SIGKILL this process here if ``name`` is armed and this is its Nth hit; otherwise nothing.

    Cheap when nothing is armed (one dict lookup), so it can sit on hot paths."""
    points = armed()
    if not points or name not in points:
        return
    with _lock:
        _hits[name] = _hits.get(name, 0) + 1
        fire = _hits[name] == points[name]
    if fire:
        # One line so a test can tell the injected death from a real crash; then die at once.
        sys.stderr.write(f"aenv: fault point {name} fired: SIGKILL\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def reset(raw: str | None = None) -> None:
    """Re-read the arming (unit tests; ``raw`` overrides the environment)."""
    global _armed
    with _lock:
        _hits.clear()
        _armed = _parse(raw) if raw is not None else None

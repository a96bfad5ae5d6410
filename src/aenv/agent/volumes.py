"""The guest half of vm volumes: mount the host's 9p export and bind each volume at its path.

The vm host's HELLO carries ``{"volumes": {"epoch": ..., "mounts": [{"slot", "path", "readOnly"}]}}``
(``runtime/vm/volumes.py``). The epoch names the QEMU process: a guest restored into another QEMU
(restore, fork, rollback, resume from disk) still has the mounts of the old one, whose 9p fids the
new server does not know, so those are detached (lazily: a process may still hold a file there)
and the export is mounted again. A HELLO of the same epoch (a plain resume) changes nothing.

What was done is written to :data:`STATE` (root only) for the host to check; a failure is reported
there and on the console, never raised: the channel must keep working either way.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from aenv.agent import launch

log = logging.getLogger("aenv.agent.volumes")

STATE = Path("/run/aenv/volumes.json")
EXPORT_MOUNT = Path("/run/aenv/volumes")
TAG = "aenv-volumes"  # the 9p mount tag of the host's export (runtime/vm/cmdline.py)


def _load() -> dict[str, Any]:
    try:
        state = json.loads(STATE.read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _save(state: dict[str, Any]) -> None:
    STATE.parent.mkdir(parents=True, exist_ok=True)
    tmp = STATE.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f)
    tmp.replace(STATE)


def _valid(mounts: object) -> list[dict[str, Any]]:
    if not isinstance(mounts, list):
        raise ValueError("mounts must be a list")  # noqa: TRY004
    out = []
    for m in mounts:
        if not (isinstance(m, dict) and isinstance(m.get("slot"), str) and m["slot"].startswith("vol-")
                and "/" not in m["slot"] and isinstance(m.get("path"), str) and m["path"].startswith("/")):
            raise ValueError(f"bad mount {m!r}")
        out.append(m)
    return out


def apply(facts: object) -> None:
    """Make the guest's volume mounts those of ``facts`` (the HELLO's ``volumes``)."""
    if not isinstance(facts, dict) or not isinstance(facts.get("epoch"), str):
        return
    current = _load()
    if current.get("epoch") == facts["epoch"] and not current.get("error"):
        return
    mounted: list[str] = []
    error = None
    try:
        wanted = _valid(facts.get("mounts", []))
        for path in reversed(current.get("mounted") or []):
            launch.detach(str(path))
        launch.detach(str(EXPORT_MOUNT))
        if wanted:
            EXPORT_MOUNT.mkdir(mode=0o755, parents=True, exist_ok=True)
            launch.mount(TAG, str(EXPORT_MOUNT), "9p", launch.MS_NODEV | launch.MS_NOSUID,
                         "trans=virtio,version=9p2000.L,msize=262144")
        for m in wanted:
            path = os.path.normpath(m["path"])
            os.makedirs(path, exist_ok=True)
            launch.mount(str(EXPORT_MOUNT / m["slot"]), path, None, launch.MS_BIND)
            mounted.append(path)  # detached again by the next epoch even if the read-only remount fails
            if m.get("readOnly"):
                launch.mount("none", path, None,
                             launch.MS_BIND | launch.MS_REMOUNT | launch.MS_RDONLY | launch.MS_NODEV | launch.MS_NOSUID)
    except (OSError, ValueError) as exc:
        error = str(exc)
        log.error("volumes: %s", exc)
    try:
        _save({"epoch": facts["epoch"], "mounted": mounted, "error": error})
    except OSError as exc:
        log.error("volumes: cannot write %s: %s", STATE, exc)

"""E2B volumes in a vm sandbox: one 9p export per sandbox, holding a bind of each of its volumes.

microvm has eight virtio-mmio transports and the machine uses seven, so every VM has exactly one
9p device (``cmdline.SHARE_TAG``). A template boots with it on an empty, read-only directory; a
sandbox with volumes gets an export of its own, ``<root>/<sandbox id>/vol-<i>``, each a bind of a
volume's directory made ``nodev,nosuid`` (and ``ro`` for a read-only mount). Read-only is enforced
here, on the host: the guest's root could remount its own view read-write, but QEMU writes through
a read-only bind and gets EROFS. The guest agent mounts the export and binds ``vol-<i>`` at each
mount point (``agent/volumes.py``), told what to mount by the host's HELLO.

Why not binds inside the run dir: run dirs are removed with ``rmtree`` in many places, and an
rmtree that walks into a bind deletes the volume's files. An export is only ever taken apart by
:func:`release`: detach each bind, then ``rmdir`` (which cannot remove a non-empty directory).

A QEMU sees the export as it was when it started (it runs in a mount namespace of its own, with
private propagation), so a sandbox with volumes never uses a QEMU spawned ahead by a pool.

Every new QEMU is a new 9p server: the guest's old fids mean nothing to it. The HELLO therefore
names the QEMU (its ``epoch``); a guest whose mounts belong to another epoch (a restore, fork,
rollback or resume from disk) detaches them and mounts again. QEMU refuses a migration while the
export is mounted, which only the stream saves of a VM that owns its RAM (a cold boot) use: its
snapshot is refused (``StateError``) and its pause stays in RAM (``Releaser.keep_reason``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aenv.agent import launch
from aenv.agent import volumes as guest
from aenv.errors import RuntimeFailure
from aenv.runtime.base import SandboxSpec, VolumeBind
from aenv.runtime.ns.disk import mount_at

GUEST_STATE = str(guest.STATE)  # written by the guest agent: what it mounted, for which epoch
GUEST_EXPORT = str(guest.EXPORT_MOUNT)  # where the guest agent mounts the export


class VolumeExportError(RuntimeFailure):
    """A volume could not be bound into a sandbox's export (the message names it)."""


def slot(index: int) -> str:
    """The name of a sandbox's ``index``-th volume in its export (and under the guest's mount)."""
    return f"vol-{index}"


class VolumeExports:
    """The exports of this node's vm sandboxes, under ``root`` (never inside a run dir)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def share_for(self, spec: SandboxSpec | None) -> Path | None:
        """The export a QEMU for ``spec`` serves, or None: the template's empty one will do."""
        return self.root / spec.sandbox_id if spec is not None and spec.volumes else None

    def prepare(self, spec: SandboxSpec) -> Path | None:
        """Bind ``spec``'s volumes into its export (blocking). Idempotent: a slot already bound
        (a resume, a rollback, a server restart) stays as it is."""
        export = self.share_for(spec)
        if export is None:
            return None
        export.mkdir(mode=0o700, parents=True, exist_ok=True)
        for i, v in enumerate(spec.volumes):
            try:
                _bind(v, export / slot(i))
            except OSError as exc:
                release(export)
                raise VolumeExportError(f"sandbox {spec.sandbox_id}: volume at {v.path}: {exc.strerror or exc}",
                                        sandbox_id=spec.sandbox_id) from exc
        return export

    def release(self, sandbox_id: str) -> None:
        """Take the sandbox's export apart (blocking; idempotent). Never deletes a volume's files."""
        release(self.root / sandbox_id)

    def sweep(self, keep: set[str]) -> list[str]:
        """Release every export no sandbox in ``keep`` owns (leftovers of a crash). Returns them."""
        gone: list[str] = []
        if not self.root.is_dir():
            return gone
        for d in sorted(self.root.iterdir()):
            if d.name not in keep:
                release(d)
                gone.append(d.name)
        return gone


def _bind(v: VolumeBind, target: Path) -> None:
    if mount_at(target) is not None:  # os.path.ismount misses a bind within one filesystem
        return
    target.mkdir(mode=0o700, exist_ok=True)
    launch.mount(str(v.source), str(target), None, launch.MS_BIND)
    flags = launch.MS_BIND | launch.MS_REMOUNT | launch.MS_NODEV | launch.MS_NOSUID
    try:
        launch.mount("none", str(target), None, flags | (launch.MS_RDONLY if v.read_only else 0))
    except OSError:
        launch.detach(str(target))
        raise


def release(export: Path) -> None:
    """Detach every bind of ``export`` and remove its (then empty) directories; rmdir, never rmtree."""
    if not export.is_dir():
        return
    for entry in sorted(export.iterdir()):
        launch.detach(str(entry))  # a failure leaves it mounted, and the rmdir below refuses (EBUSY)
        try:
            entry.rmdir()
        except FileNotFoundError:
            pass
    export.rmdir()


def _literal(path: str) -> str:
    """``path`` as a POSIX extended regular expression that matches only itself."""
    return "".join(c if c.isalnum() or c in "/_-" else "\\^" if c == "^" else f"[{c}]" for c in path)


def holders_command(binds: Sequence[VolumeBind]) -> str:
    """A guest shell command that prints one line per open file, working directory, root or mapped
    file on a volume mount (``/proc/<pid>/... -> <path>``); nothing when none is in use. Two
    processes (ls, grep) whatever the number of processes and files: under TCG each exec costs."""
    points = "|".join(_literal(p) for p in [*(v.path for v in binds), GUEST_EXPORT])
    return (f"ls -l /proc/[0-9]*/cwd /proc/[0-9]*/root /proc/[0-9]*/fd/* /proc/[0-9]*/map_files/* 2>/dev/null "
            f"| grep -E ' -> ({points})(/.*)?$' | sed 's/^.* \\(\\/proc\\/\\)/\\1/' | head -5 || true")


def hello_facts(binds: Sequence[VolumeBind], epoch: str) -> dict[str, Any]:
    """The HELLO extension's ``volumes`` entry: which QEMU this is, and where each slot goes."""
    return {"epoch": epoch, "mounts": [{"slot": slot(i), "path": v.path, "readOnly": v.read_only}
                                       for i, v in enumerate(binds)]}


def check_guest_state(raw: bytes, epoch: str, binds: Sequence[VolumeBind]) -> str | None:
    """What is wrong with the guest agent's report (``GUEST_STATE``), or None when every volume is
    mounted for this QEMU."""
    try:
        state = json.loads(raw)
    except ValueError:
        return "the guest wrote no readable volume state"
    if not isinstance(state, dict) or state.get("epoch") != epoch:
        return "the guest did not mount the volumes for this VM (an older agent, or no HELLO yet)"
    if state.get("error"):
        return f"the guest could not mount them: {state['error']}"
    missing = sorted({v.path for v in binds} - set(state.get("mounted") or ()))
    return f"not mounted in the guest: {', '.join(missing)}" if missing else None

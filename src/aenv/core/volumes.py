"""E2B volumes: persistent directories that outlive sandboxes and are mounted into them.

A volume is a row (``store/volumes.py``) and a directory under ``settings.volumes_dir`` (on the
sandboxes volume: ns makes each a quota subvolume limited to ``volume_size_mb``, so volume bytes count
under the node's disk budget as sandboxes' do). Its content API (``/volumecontent/{id}/…``, a bearer
token per volume) works on that directory (``runtime/volume_files.py``) whether or not it is mounted.

Mounts (``volumeMounts`` of a create): read-write in one sandbox at a time, read-only in any number
of others (beside the writer too) - a second read-write mount is a Conflict (409) naming the sandbox
that holds the first. A mount is read-only when asked for (``readOnly: true``, or the SDK's plain
volume name with ``:ro`` appended); every sandbox the table knows (running, paused, stopped) holds
its mounts until it ends.
Fork children carry their parent's mounts read-only (the parent keeps its own); a snapshot carries no
volume: its content stays in the volume, shared, and a create from the snapshot mounts what it asks.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import posixpath
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from aenv.config import Settings
from aenv.core.ids import new_id, new_token
from aenv.core.models import MountRequest
from aenv.core.table import SandboxTable
from aenv.errors import Conflict, InvalidRequest, NotFound
from aenv.runtime.base import Runtime, VolumeBind, VolumeCapable
from aenv.runtime.volume_files import VolumeDir
from aenv.store.sqlite import SandboxRow, Store, now
from aenv.store.volumes import CREATING, DESTROYING, READY, VolumeLog, VolumeRow

log = logging.getLogger("aenv.core.volumes")

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
READ_ONLY_SUFFIX = ":ro"
# Where a volume may not go: the sandbox's own machinery and the kernel's filesystems.
RESERVED = ("/proc", "/sys", "/dev", "/.aenv", "/.aenv-run")
# A new volume's root: writable by every user of a sandbox (its default user is seldom root), as /tmp is.
ROOT_MODE = 0o1777


class VolumeNotFound(NotFound):
    pass


def check_name(name: str) -> None:
    if not NAME_RE.match(name):
        raise InvalidRequest(f"name: '{name}' is not a valid volume name (1-63 letters, digits, '.', '_', '-', "
                             "starting with a letter or digit)")


def check_mount_path(path: str, field: str = "volumeMounts") -> str:
    """The normalised mount path, or InvalidRequest saying why it cannot be one."""
    if not path.startswith("/") or "\x00" in path:
        raise InvalidRequest(f"{field}: path '{path}' must be absolute")
    norm = posixpath.normpath(path)
    if norm == "/" or norm.startswith("//"):
        raise InvalidRequest(f"{field}: a volume cannot be mounted at '{path}'")
    for r in RESERVED:
        if norm == r or norm.startswith(r + "/"):
            raise InvalidRequest(f"{field}: '{path}' is reserved ({r})")
    return norm


def parse_mounts(raw: list[tuple[str, str, bool]]) -> list[MountRequest]:
    """``(name, path, read_only)`` from the API, checked: names, paths, no path twice or nested, no
    volume twice."""
    out: list[MountRequest] = []
    for name, path, ro in raw:
        if name.endswith(READ_ONLY_SUFFIX):
            name, ro = name[: -len(READ_ONLY_SUFFIX)], True
        check_name(name)
        out.append(MountRequest(name, check_mount_path(path), ro))
    paths = sorted(m.path for m in out)
    for a, b in zip(paths, paths[1:], strict=False):
        if a == b or b.startswith(a + "/"):
            raise InvalidRequest(f"volumeMounts: '{b}' is at or inside another mount ('{a}')")
    names = [m.name for m in out]
    for n in names:
        if names.count(n) > 1:
            raise InvalidRequest(f"volumeMounts: volume '{n}' is mounted twice")
    return out


class Volumes:
    def __init__(self, settings: Settings, store: Store, runtime: Runtime, table: SandboxTable) -> None:
        self.settings = settings
        self.log = VolumeLog(store)
        self.runtime = runtime
        self.table = table
        self.root = settings.volumes_dir
        self._lock = asyncio.Lock()  # create/destroy against each other and against mounts

    @property
    def mountable(self) -> bool:
        return isinstance(self.runtime, VolumeCapable)

    def path(self, volume_id: str) -> Path:
        return self.root / volume_id

    # ---- recovery -------------------------------------------------------------------------------
    async def start(self) -> None:
        """After the runtime started (ns: the sandboxes volume is mounted): finish what a crash cut
        short - a volume still ``creating`` or ``destroying`` is removed, its row last; in cluster mode
        the ready ones are bound to this node's new incarnation."""
        await asyncio.to_thread(self.root.mkdir, parents=True, exist_ok=True)
        for row in self.log.all():
            if row.state != READY:
                await asyncio.to_thread(self._remove_dir, row.id)
                self.log.delete(row.id)
                log.info("volume=%s (%s) removed: it was %s when the server stopped", row.id, row.name, row.state)
            elif not self.path(row.id).is_dir():
                log.warning("volume=%s (%s): its directory is missing; made again empty", row.id, row.name)
                await asyncio.to_thread(self._make_dir, row.id)
        binder = self.log.store.binder
        if binder is not None:  # cluster mode: this incarnation holds them (the files are here)
            ready = [(r.id, r.owner, r.name) for r in self.log.all() if r.state == READY]
            for vid, why in (await asyncio.to_thread(binder.claim_volumes, ready)).items():
                log.warning("volume=%s is not bound to this node in the cluster directory (%s): reachable only "
                            "on this node itself", vid, why)

    def _make_dir(self, volume_id: str) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.path(volume_id)
        if isinstance(self.runtime, VolumeCapable):
            self.runtime.make_volume_dir(path, self.settings.volume_size_mb)
        else:
            path.mkdir(exist_ok=True)
        path.chmod(ROOT_MODE)

    def _remove_dir(self, volume_id: str) -> None:
        path = self.path(volume_id)
        if isinstance(self.runtime, VolumeCapable):
            self.runtime.remove_volume_dir(path)
        else:
            shutil.rmtree(path, ignore_errors=True)

    # ---- the control plane ----------------------------------------------------------------------
    async def create(self, owner: str, name: str) -> VolumeRow:
        check_name(name)
        async with self._lock:
            if len(self.log.of_owner(owner)) >= self.settings.max_volumes:
                raise InvalidRequest(f"volume limit reached ({self.settings.max_volumes} per team)")
            row = VolumeRow(id=new_id(), name=name, owner=owner, token=new_token(), state=CREATING, created_at=now())
            self.log.put(row)  # a name already taken is a Conflict here
            try:
                await asyncio.to_thread(self._make_dir, row.id)
            except BaseException:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(self._remove_dir, row.id)
                self.log.delete(row.id)
                raise
            self.log.set_state(row.id, READY)
            row.state = READY
        log.info("volume=%s created name=%s", row.id, name)
        return row

    async def adopt(self, info: dict[str, Any], fetched: Path) -> VolumeRow:
        """Make the volume ``info`` (id, name, owner, token: from a published pause) here with the files
        of ``fetched`` (its data from the snapshot store, moved in and removed). The directory binds it
        here already; a volume this node holds is kept as it is."""
        row = VolumeRow(id=str(info["id"]), name=str(info["name"]), owner=str(info.get("owner") or ""),
                        token=str(info["token"]), state=READY, created_at=float(info.get("created_at") or now()))  # fmt: skip
        async with self._lock:
            if self.log.get(row.id) is None:
                await asyncio.to_thread(self._make_dir, row.id)
                await asyncio.to_thread(_fill, fetched, self.path(row.id))
                self.log.put_adopted(row)
                log.info("volume=%s (%s) taken over with its data from the snapshot store", row.id, row.name)
        await asyncio.to_thread(shutil.rmtree, fetched, True)
        return row

    def get(self, owner: str | None, volume_id: str) -> VolumeRow:
        """``owner``'s volume (None: anyone's, for an admin); another team's is as unknown as no volume."""
        row = self.log.get(volume_id)
        if row is None or (owner is not None and row.owner != owner) or row.state != READY:
            raise VolumeNotFound(f"volume '{volume_id}' not found", volume=volume_id)
        return row

    def of_owner(self, owner: str | None) -> list[VolumeRow]:
        if owner is None:
            return [r for r in self.log.all() if r.state == READY]
        return self.log.of_owner(owner)

    async def destroy(self, owner: str | None, volume_id: str) -> None:
        async with self._lock:
            row = self.get(owner, volume_id)
            users = self.holders(row.id)
            if users:
                raise Conflict(f"volume '{row.name}' is mounted by sandbox {', '.join(sorted(users))}: kill it first",
                               volume=row.id)
            self.log.set_state(row.id, DESTROYING)
            await asyncio.to_thread(self._remove_dir, row.id)
            self.log.delete(row.id)
        log.info("volume=%s destroyed name=%s", row.id, row.name)

    # ---- the content API ------------------------------------------------------------------------
    def content(self, volume_id: str, token: str | None) -> VolumeDir:
        """The volume's directory for a content request bearing ``token``; a wrong or missing token
        reads as an unknown volume (it says nothing about which IDs exist)."""
        row = self.log.get(volume_id)
        if row is None or row.state != READY or token is None or not hmac.compare_digest(row.token, token):
            raise VolumeNotFound(f"volume '{volume_id}' not found", volume=volume_id)
        return VolumeDir(self.path(row.id))

    # ---- mounts ---------------------------------------------------------------------------------
    def holders(self, volume_id: str, *, writers_only: bool = False) -> dict[str, bool]:
        """Sandbox ID -> read-only, for every sandbox the table knows that mounts the volume."""
        out: dict[str, bool] = {}
        for sbx in self.table:
            for m in sbx.row.volume_mounts:
                if m.get("volumeID") == volume_id and not (writers_only and m.get("readOnly")):
                    out[sbx.id] = bool(m.get("readOnly"))
        return out

    def resolve(self, owner: str, mounts: list[MountRequest]) -> list[dict[str, Any]]:
        """The rows' ``volume_mounts`` for a create, checked against every live mount. Synchronous on
        purpose: the caller adds the sandbox to the table before its next await, so two creates
        cannot both take a volume read-write."""
        if mounts and not self.mountable:
            raise InvalidRequest(f"volumeMounts: the {self.runtime.name} runtime does not mount volumes "
                                 "(volumes work on ns; on vm only through the volume content API)")
        out: list[dict[str, Any]] = []
        for m in mounts:
            row = self.log.by_name(owner, m.name)
            if row is None or row.state != READY:
                raise VolumeNotFound(f"volumeMounts: volume '{m.name}' not found", volume=m.name)
            writer = next(iter(self.holders(row.id, writers_only=True)), None)
            if writer is not None and not m.read_only:
                raise Conflict(f"volume '{m.name}' is mounted read-write by sandbox {writer}: a volume has one "
                               f"writer at a time; mount it read-only ('{m.name}{READ_ONLY_SUFFIX}' or readOnly: true)",
                               volume=row.id)
            out.append({"name": m.name, "path": m.path, "volumeID": row.id, "readOnly": m.read_only})
        return out

    def binds(self, row: SandboxRow) -> tuple[VolumeBind, ...]:
        """What the runtime binds for ``row`` (``Context.spec_for``)."""
        return tuple(VolumeBind(self.path(m["volumeID"]), m["path"], bool(m.get("readOnly")))
                     for m in row.volume_mounts)


def as_read_only(mounts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A fork child's mounts: its parent's, read-only (the parent keeps a read-write one)."""
    return [{**m, "readOnly": True} for m in mounts]


def _fill(src: Path, dest: Path) -> None:
    """Copy ``src``'s entries into the existing directory ``dest`` (owners, modes, xattrs kept)."""
    subprocess.run(["cp", "-a", "--reflink=auto", "-T", str(src), str(dest)], check=True, capture_output=True)

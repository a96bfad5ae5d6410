"""The E2B volume content API's file operations on one volume directory (``core/volumes.py``).

A volume may be mounted read-write in a sandbox, so anything in it (a symlink to ``/etc``, a
directory swapped for a link between two calls) is the sandbox's doing. Every path is therefore
walked from an fd of the volume's root one component at a time with ``O_NOFOLLOW``: a symlink is only
ever an entry (stat shows it, remove removes it), never followed, and ``..`` cannot climb out (paths
are normalised against ``/`` first). Blocking: call these in a thread.

Errors: NotFound (a missing path, or a parent that is not a directory), Conflict (it exists, or is the
wrong kind), InvalidRequest (a full volume, the root where a file is meant).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import os
import posixpath
import secrets
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aenv.errors import Conflict, InvalidRequest, NotFound

DEFAULT_FILE_MODE = 0o644
DEFAULT_DIR_MODE = 0o755
CHUNK = 1 << 20
MAX_DEPTH = 32
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def normalize(path: str) -> str:
    """The volume path as the API shows it: absolute, normalised, never above ``/``."""
    if "\x00" in path:
        raise InvalidRequest("path: must not contain NUL")
    return posixpath.normpath("/" + path.strip().lstrip("/"))


def _parts(path: str) -> list[str]:
    return [p for p in normalize(path).split("/") if p]


@dataclass(frozen=True)
class Owner:
    uid: int | None = None
    gid: int | None = None
    mode: int | None = None


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat()


def _entry(path: str, st: os.stat_result, target: str | None = None) -> dict[str, Any]:
    kind = ("directory" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode)
            else "symlink" if stat.S_ISLNK(st.st_mode) else "unknown")
    out: dict[str, Any] = {
        "name": posixpath.basename(path) or "/", "type": kind, "path": path,
        "size": st.st_size, "mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid, "gid": st.st_gid,
        "atime": _iso(st.st_atime), "mtime": _iso(st.st_mtime), "ctime": _iso(st.st_ctime),
    }  # fmt: skip
    if target is not None:
        out["target"] = target
    return out


def _os_error(exc: OSError, path: str) -> Exception:
    if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
        return NotFound(f"path {path} not found")
    if exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR):
        return Conflict(f"path {path}: {os.strerror(exc.errno)}")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return InvalidRequest(f"path {path}: the volume is full")
    return exc


class VolumeDir:
    """File operations on one volume's directory (``root``)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @contextlib.contextmanager
    def _parent(self, path: str, *, create: Owner | None = None) -> Iterator[tuple[int, str]]:
        """An fd of the directory holding ``path``'s last component, and that name ('' for the root).
        ``create``: missing parents are made (``make_dir(force=True)``) with that owner and mode."""
        parts = _parts(path)
        fd = os.open(self.root, _DIR_FLAGS)
        try:
            for i, part in enumerate(parts[:-1]):
                try:
                    nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if create is None:
                        raise NotFound(f"path /{'/'.join(parts[:i + 1])} not found") from None
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, create.mode if create.mode is not None else DEFAULT_DIR_MODE, dir_fd=fd)
                        _set_owner(fd, part, Owner(create.uid, create.gid, create.mode), DEFAULT_DIR_MODE)
                    nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    raise _os_error(exc, "/" + "/".join(parts[: i + 1])) from None
                os.close(fd)
                fd = nxt
            yield fd, parts[-1] if parts else ""
        finally:
            os.close(fd)

    def _stat_at(self, fd: int, name: str, path: str) -> dict[str, Any]:
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False) if name else os.fstat(fd)
            target = os.readlink(name, dir_fd=fd) if name and stat.S_ISLNK(st.st_mode) else None
        except OSError as exc:
            raise _os_error(exc, path) from None
        return _entry(path, st, target)

    # ---- the API's operations -------------------------------------------------------------------
    def stat(self, path: str) -> dict[str, Any]:
        with self._parent(path) as (fd, name):
            return self._stat_at(fd, name, normalize(path))

    def listdir(self, path: str, depth: int = 1) -> list[dict[str, Any]]:
        if not 1 <= depth <= MAX_DEPTH:
            raise InvalidRequest(f"depth: must be between 1 and {MAX_DEPTH}")
        base = normalize(path)
        with self._parent(path) as (fd, name):
            try:
                dfd = os.open(name, _DIR_FLAGS, dir_fd=fd) if name else os.dup(fd)
            except OSError as exc:
                raise _os_error(exc, base) from None
        try:
            out: list[dict[str, Any]] = []
            self._walk(dfd, base, depth, out)
            return out
        finally:
            os.close(dfd)

    def _walk(self, dfd: int, base: str, depth: int, out: list[dict[str, Any]]) -> None:
        for name in sorted(os.listdir(dfd)):
            child = posixpath.join(base, name)
            entry = self._stat_at(dfd, name, child)
            out.append(entry)
            if depth > 1 and entry["type"] == "directory":
                sub = os.open(name, _DIR_FLAGS, dir_fd=dfd)
                try:
                    self._walk(sub, child, depth - 1, out)
                finally:
                    os.close(sub)

    def make_dir(self, path: str, owner: Owner, force: bool) -> dict[str, Any]:
        norm = normalize(path)
        with self._parent(path, create=owner if force else None) as (fd, name):
            if not name:
                raise Conflict("path / already exists")
            try:
                os.mkdir(name, owner.mode if owner.mode is not None else DEFAULT_DIR_MODE, dir_fd=fd)
            except FileExistsError:
                entry = self._stat_at(fd, name, norm)
                if force and entry["type"] == "directory":
                    return entry
                raise Conflict(f"path {norm} already exists") from None
            except OSError as exc:
                raise _os_error(exc, norm) from None
            _set_owner(fd, name, owner, DEFAULT_DIR_MODE)
            return self._stat_at(fd, name, norm)

    def open_read(self, path: str) -> int:
        """An fd of the regular file at ``path`` (the caller closes it)."""
        norm = normalize(path)
        with self._parent(path) as (fd, name):
            if not name:
                raise InvalidRequest(f"path {norm} is a directory")
            try:  # O_PATH first: opening a device node or FIFO a sandbox made could act on the host
                pfd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as exc:
                raise _os_error(exc, norm) from None
        try:
            if not stat.S_ISREG(os.fstat(pfd).st_mode):
                raise InvalidRequest(f"path {norm} is not a regular file")
            return os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_CLOEXEC)  # that same inode
        finally:
            os.close(pfd)

    def begin_write(self, path: str, force: bool) -> PendingFile:
        """A temporary file beside ``path``; ``PendingFile.commit`` renames it into place."""
        norm = normalize(path)
        with self._parent(path) as (fd, name):
            if not name:
                raise InvalidRequest("path / is the volume's root, not a file")
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    raise Conflict(f"path {norm} is a directory")
                if not force:
                    raise Conflict(f"path {norm} already exists (write with force to overwrite)")
            tmp = f".aenv-upload-{secrets.token_hex(8)}"
            try:
                ffd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd)
            except OSError as exc:
                raise _os_error(exc, norm) from None
            return PendingFile(os.dup(fd), tmp, name, norm, ffd, force)

    def update(self, path: str, owner: Owner) -> dict[str, Any]:
        norm = normalize(path)
        with self._parent(path) as (fd, name):
            self._stat_at(fd, name, norm)  # NotFound first
            if name:
                _set_owner(fd, name, owner, None)
            else:
                _set_fd_owner(fd, owner)
            return self._stat_at(fd, name, norm)

    def remove(self, path: str) -> None:
        norm = normalize(path)
        with self._parent(path) as (fd, name):
            if not name:
                raise InvalidRequest("path /: the volume's root cannot be removed (destroy the volume)")
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    _rmtree_at(fd, name)
                else:
                    os.unlink(name, dir_fd=fd)
            except OSError as exc:
                raise _os_error(exc, norm) from None


class PendingFile:
    """An upload in progress: ``write`` chunks, then ``commit`` (rename into place) or ``abort``."""

    def __init__(self, dir_fd: int, tmp: str, name: str, path: str, fd: int, force: bool) -> None:
        self.dir_fd, self.tmp, self.name, self.path, self.fd, self.force = dir_fd, tmp, name, path, fd, force
        self.closed = False

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                n = os.write(self.fd, view)
                view = view[n:]
        except OSError as exc:
            raise _os_error(exc, self.path) from None

    def commit(self, owner: Owner) -> dict[str, Any]:
        try:
            _set_fd_owner(self.fd, Owner(owner.uid or 0, owner.gid or 0,
                                         owner.mode if owner.mode is not None else DEFAULT_FILE_MODE))
            if self.force:
                os.rename(self.tmp, self.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
            else:  # no overwrite of what appeared meanwhile
                os.link(self.tmp, self.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd, follow_symlinks=False)
                os.unlink(self.tmp, dir_fd=self.dir_fd)
            st = os.stat(self.name, dir_fd=self.dir_fd, follow_symlinks=False)
        except OSError as exc:
            self.abort()
            raise _os_error(exc, self.path) from None
        self.close()
        return _entry(self.path, st)

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.tmp, dir_fd=self.dir_fd)
        self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self.fd)
            os.close(self.dir_fd)


def _set_fd_owner(fd: int, owner: Owner) -> None:
    if owner.uid is not None or owner.gid is not None:
        os.fchown(fd, -1 if owner.uid is None else owner.uid, -1 if owner.gid is None else owner.gid)
    if owner.mode is not None:
        os.fchmod(fd, owner.mode)


def _set_owner(dir_fd: int, name: str, owner: Owner, default_mode: int | None) -> None:
    """chown/chmod the entry ``name`` without following it (a symlink keeps its mode)."""
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        if owner.uid is not None or owner.gid is not None:
            os.chown(name, -1 if owner.uid is None else owner.uid, -1 if owner.gid is None else owner.gid,
                     dir_fd=dir_fd, follow_symlinks=False)
        mode = owner.mode if owner.mode is not None else default_mode
        if mode is not None and not stat.S_ISLNK(os.fstat(fd).st_mode):
            os.chmod(f"/proc/self/fd/{fd}", mode)  # an O_PATH fd: the inode itself, never a link target
    finally:
        os.close(fd)


def _rmtree_at(dir_fd: int, name: str) -> None:
    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    try:
        for child in os.listdir(fd):
            st = os.stat(child, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                _rmtree_at(fd, child)
            else:
                os.unlink(child, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)

"""Build ``filesystem.EntryInfo`` JSON from the filesystem (messages doc, EntryInfo).

lstat-based: a symlink reports its target's type and permission bits, the fully
resolved target in ``symlinkTarget`` and ``isSymlink: true``; ``permissions``
is Go ``FileMode.String()`` of the entry itself (``Lrwxrwxrwx`` for a link).

``size`` is the lstat size, as E2B's envd reports it, except for directories of the sandbox's root
filesystem: E2B's root is ext4, where a directory is whole blocks (4096 bytes while it is small),
while the ns runtime's root is overlayfs on btrfs, where a directory reports the bytes of its names
(0 when empty). Those are given in the root's block units, at least one block, so a directory
reads as on E2B (on the vm runtime's ext4 root this changes nothing).
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
import time

from aenv.envd.fields import Message

FILE_TYPE_UNSPECIFIED = "FILE_TYPE_UNSPECIFIED"
FILE_TYPE_FILE = "FILE_TYPE_FILE"
FILE_TYPE_DIRECTORY = "FILE_TYPE_DIRECTORY"

METADATA_XATTR_PREFIX = "user.e2b."


def go_permissions(mode: int) -> str:
    """Go ``fs.FileMode.String()`` for a ``st_mode``: type letters "dalTLDpSugct?" then rwx bits."""
    letters = ""
    fmt = stat.S_IFMT(mode)
    if fmt == stat.S_IFDIR:
        letters += "d"
    if fmt == stat.S_IFLNK:
        letters += "L"
    if fmt in (stat.S_IFBLK, stat.S_IFCHR):
        letters += "D"
    if fmt == stat.S_IFIFO:
        letters += "p"
    if fmt == stat.S_IFSOCK:
        letters += "S"
    if mode & stat.S_ISUID:
        letters += "u"
    if mode & stat.S_ISGID:
        letters += "g"
    if fmt == stat.S_IFCHR:
        letters += "c"
    if mode & stat.S_ISVTX:
        letters += "t"
    rwx = "".join(ch if mode & (1 << (8 - i)) else "-" for i, ch in enumerate("rwxrwxrwx"))
    return (letters or "-") + rwx


def rfc3339_ns(ns: int) -> str:
    """A protobuf-JSON Timestamp: UTC, 0/3/6/9 fractional digits, trailing Z."""
    seconds, nanos = divmod(ns, 1_000_000_000)
    base = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    if nanos == 0:
        return base + "Z"
    if nanos % 1_000_000 == 0:
        return f"{base}.{nanos // 1_000_000:03d}Z"
    if nanos % 1_000 == 0:
        return f"{base}.{nanos // 1_000:06d}Z"
    return f"{base}.{nanos:09d}Z"


def file_type(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return FILE_TYPE_DIRECTORY
    if stat.S_ISREG(mode):
        return FILE_TYPE_FILE
    # Devices, fifos and sockets have no FileType of their own; envd leaves them unspecified
    # (and the SDK's list() skips them).
    return FILE_TYPE_UNSPECIFIED


class NameCache:
    """uid/gid → name, looked up in the sandbox's passwd/group once per request."""

    def __init__(self) -> None:
        self._users: dict[int, str] = {}
        self._groups: dict[int, str] = {}

    def user(self, uid: int) -> str:
        if uid not in self._users:
            try:
                self._users[uid] = pwd.getpwuid(uid).pw_name
            except KeyError:
                self._users[uid] = str(uid)
        return self._users[uid]

    def group(self, gid: int) -> str:
        if gid not in self._groups:
            try:
                self._groups[gid] = grp.getgrgid(gid).gr_name
            except KeyError:
                self._groups[gid] = str(gid)
        return self._groups[gid]


def read_metadata(path: str) -> dict[str, str]:
    """``user.e2b.*`` xattrs of ``path`` with the prefix stripped; empty where xattrs are unsupported."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return {}
    out: dict[str, str] = {}
    for name in names:
        if name.startswith(METADATA_XATTR_PREFIX):
            try:
                value = os.getxattr(path, name, follow_symlinks=False)
            except OSError:
                continue
            out[name[len(METADATA_XATTR_PREFIX) :]] = value.decode("utf-8", "replace")
    return out


_root_dev: int | None = None


def entry_size(st: os.stat_result) -> int:
    """The ``size`` E2B would report for this entry (see the module's docstring)."""
    global _root_dev
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size
    if _root_dev is None:
        _root_dev = os.stat("/").st_dev
    if st.st_dev != _root_dev:
        return st.st_size
    block = st.st_blksize or 4096
    return max(block, -(-st.st_size // block) * block)


def entry_info(path: str, names: NameCache | None = None, display_path: str | None = None) -> Message:
    """EntryInfo for ``path`` (raises ``OSError`` if it cannot be lstat-ed).

    ``display_path`` is the path reported to the client (ListDir keeps the
    requested prefix even when it walked through a symlinked directory).
    """
    names = names or NameCache()
    st = os.lstat(path)
    shown = display_path or path
    info: Message = {
        "name": os.path.basename(shown.rstrip("/")) or "/",
        "type": file_type(st.st_mode),
        "path": shown,
        "size": str(entry_size(st)),
        "mode": stat.S_IMODE(st.st_mode) & 0o777,
        "permissions": go_permissions(st.st_mode),
        "owner": names.user(st.st_uid),
        "group": names.group(st.st_gid),
        "modifiedTime": rfc3339_ns(st.st_mtime_ns),
    }
    if stat.S_ISLNK(st.st_mode):
        info["isSymlink"] = True
        try:
            target = os.path.realpath(path, strict=True)
            target_st = os.stat(path)
        except OSError:
            # Unresolvable (dangling or looping): like envd, report the link itself as its target.
            info["type"] = FILE_TYPE_UNSPECIFIED
            info["mode"] = 0
            info["symlinkTarget"] = path
        else:
            info["type"] = file_type(target_st.st_mode)
            info["mode"] = stat.S_IMODE(target_st.st_mode) & 0o777
            info["symlinkTarget"] = target
    else:
        metadata = read_metadata(path)
        if metadata:
            info["metadata"] = metadata
    return info

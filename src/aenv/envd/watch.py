"""Directory watching with inotify, driven from the asyncio loop.

One ``DirWatcher`` owns one inotify fd (``inotify_simple``) registered with
``loop.add_reader``. Raw events become ``filesystem.FilesystemEvent`` dicts with
fsnotify's op semantics; an event with several op bits becomes several events
in the order CREATE, RENAME, CHMOD, WRITE, REMOVE. A recursive watcher adds a
watch for every subdirectory that appears later.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable

from inotify_simple import INotify  # type: ignore[import-untyped]
from inotify_simple import flags as F

from aenv.envd.entry import NameCache, entry_info
from aenv.envd.errors import EnvdError, Internal, InvalidArgument, NotFound, from_os_error
from aenv.envd.fields import Message

log = logging.getLogger("aenv.envd.watch")

_WATCH_MASK = (
    F.CREATE | F.MOVED_TO | F.MOVED_FROM | F.MODIFY | F.ATTRIB | F.DELETE | F.DELETE_SELF | F.MOVE_SELF
)

# (event type name, inotify bits) in envd's splitting order.
_OPS: tuple[tuple[str, int], ...] = (
    ("EVENT_TYPE_CREATE", F.CREATE | F.MOVED_TO),
    ("EVENT_TYPE_RENAME", F.MOVED_FROM | F.MOVE_SELF),
    ("EVENT_TYPE_CHMOD", F.ATTRIB),
    ("EVENT_TYPE_WRITE", F.MODIFY),
    ("EVENT_TYPE_REMOVE", F.DELETE | F.DELETE_SELF),
)
_WITH_ENTRY = {"EVENT_TYPE_CREATE", "EVENT_TYPE_WRITE", "EVENT_TYPE_CHMOD"}

NETWORK_FS_TYPES = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "ncpfs",
        "afs",
        "ceph",
        "glusterfs",
        "lustre",
        "fuse.sshfs",
        "fuse.s3fs",
        "fuse.rclone",
        "fuse.gcsfuse",
        "fuse.juicefs",
    }
)


def split_ops(mask: int) -> list[str]:
    """Event type names for one inotify mask, in envd's order."""
    return [name for name, bits in _OPS if mask & bits]


def mount_fstype(path: str, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """Filesystem type of the mount holding ``path`` (longest mount-point prefix)."""
    best, best_type = "", None
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                left, _, right = line.partition(" - ")
                parts = left.split()
                if len(parts) < 5 or not right:
                    continue
                point = parts[4].replace("\\040", " ")
                if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                    best, best_type = point, right.split()[0]
    except OSError:
        return None
    return best_type


def check_watchable(path: str, allow_network_mounts: bool) -> None:
    """Raise the Connect error WatchDir/CreateWatcher must return for ``path``, if any."""
    try:
        st_is_dir = os.path.isdir(path)
        exists = os.path.lexists(path)
    except OSError as exc:
        raise from_os_error(exc, path) from exc
    if not exists:
        raise NotFound(f"path '{path}' not found")
    if not st_is_dir:
        raise InvalidArgument(f"path '{path}' is not a directory")
    if not allow_network_mounts and mount_fstype(os.path.realpath(path)) in NETWORK_FS_TYPES:
        raise InvalidArgument(f"path '{path}' is on a network mount; set allowNetworkMounts to watch it")


class DirWatcher:
    """inotify watch on ``root`` that reports FilesystemEvent dicts to ``on_event``."""

    def __init__(
        self,
        root: str,
        recursive: bool,
        include_entry: bool,
        on_event: Callable[[Message], None],
        on_error: Callable[[EnvdError], None] | None = None,
    ) -> None:
        self.root = root
        self.recursive = recursive
        self.include_entry = include_entry
        self.on_event = on_event
        self.on_error = on_error
        self._inotify: INotify | None = None
        self._dirs: dict[int, str] = {}  # wd → path relative to root ("" for root)
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._inotify = INotify(nonblocking=True)
        try:
            self._add(self.root, "")
        except OSError as exc:
            self.close()
            raise from_os_error(exc, self.root) from exc
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._inotify.fileno(), self._on_readable)

    def close(self) -> None:
        if self._inotify is None:
            return
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._inotify.fileno())
        self._inotify.close()
        self._inotify = None
        self._dirs.clear()

    def _add(self, path: str, rel: str, announce: bool = False) -> None:
        """Watch ``path`` (and, when recursive, its subdirectories). ``announce``: the directory is
        new, so whatever already appeared in it before its watch existed is reported as created
        (``mkdir -p a/b && touch a/b/f`` is otherwise lost between the parent's event and the
        new watch). A file created in that window may be reported twice, never not at all."""
        assert self._inotify is not None
        wd = self._inotify.add_watch(path, _WATCH_MASK)
        self._dirs[wd] = rel
        if not self.recursive:
            return
        try:
            entries = list(os.scandir(path))
        except OSError:
            return
        names = NameCache() if announce else None
        for ent in entries:
            child = os.path.join(rel, ent.name) if rel else ent.name
            if names is not None:
                event: Message = {"name": child, "type": "EVENT_TYPE_CREATE"}
                if self.include_entry:
                    with contextlib.suppress(OSError):
                        event["entry"] = entry_info(ent.path, names)
                self.on_event(event)
            if ent.is_dir(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    self._add(ent.path, child, announce)

    def _on_readable(self) -> None:
        if self._inotify is None:
            return
        try:
            events = self._inotify.read(timeout=0)
        except OSError as exc:
            log.warning("inotify read on %s failed: %s", self.root, exc)
            return
        names = NameCache()
        for ev in events:
            if ev.mask & F.Q_OVERFLOW:
                # Events were lost; like envd, the watch fails rather than silently missing changes.
                log.warning("inotify queue overflow on %s; events were lost", self.root)
                if self.on_error is not None:
                    self.on_error(Internal("watcher error: inotify event queue overflow"))
                    self.close()
                    return
                continue
            if ev.mask & F.IGNORED:
                self._dirs.pop(ev.wd, None)
                continue
            rel_dir = self._dirs.get(ev.wd)
            if rel_dir is None:
                continue
            is_self = bool(ev.mask & (F.DELETE_SELF | F.MOVE_SELF))
            if is_self and rel_dir != "":
                continue  # the parent's watch already reported it
            rel = os.path.join(rel_dir, ev.name) if ev.name else (rel_dir or ".")
            full = os.path.join(self.root, rel) if rel != "." else self.root
            new_dir = self.recursive and bool(ev.mask & F.ISDIR) and bool(ev.mask & (F.CREATE | F.MOVED_TO))
            for op in split_ops(ev.mask):
                event: Message = {"name": rel, "type": op}
                if self.include_entry and op in _WITH_ENTRY:
                    with contextlib.suppress(OSError):
                        event["entry"] = entry_info(full, names)
                self.on_event(event)
            if new_dir:  # after the directory's own event, so clients see parent before children
                with contextlib.suppress(OSError):
                    self._add(full, rel, announce=True)

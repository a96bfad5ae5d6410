"""``filesystem.Filesystem`` RPC handlers (spec §3.6).

Paths resolve per §3.1 for the authenticated (or default) user; directories
envd creates are chowned to that user. Blocking filesystem walks run in a
worker thread so a big ListDir or Remove never stalls process streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import stat
import uuid
from collections.abc import AsyncIterator

import anyio

from aenv.envd.connect import CallContext, ServerStreamEndpoint, UnaryEndpoint
from aenv.envd.entry import NameCache, entry_info
from aenv.envd.errors import (
    AlreadyExists,
    EnvdError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    from_os_error,
)
from aenv.envd.fields import Message, get_bool, get_int, get_str
from aenv.envd.identity import SandboxState, User
from aenv.envd.watch import DirWatcher, check_watchable

_KEEPALIVE: Message = {"keepalive": {}}
MAX_WATCHER_EVENTS = 100_000


def make_dirs(path: str, user: User) -> None:
    """``mkdir -p path``, chowning each directory it creates to ``user``."""
    missing: list[str] = []
    cur = path
    while not os.path.isdir(cur):
        missing.append(cur)
        parent = os.path.dirname(cur)
        if parent == cur:
            break
        cur = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o755)
        except FileExistsError:
            if not os.path.isdir(d):
                raise
            continue
        if user.owns_files():
            os.chown(d, user.uid, user.gid)


def list_dir(root: str, display_root: str, depth: int) -> list[Message]:
    """Entries up to ``depth`` levels below ``root``, pre-order and lexical, without ``root`` itself."""
    names = NameCache()
    out: list[Message] = []

    def walk(real: str, shown: str, level: int) -> None:
        try:
            children = sorted(os.listdir(real))
        except OSError:
            return
        for name in children:
            child_real, child_shown = os.path.join(real, name), os.path.join(shown, name)
            try:
                info = entry_info(child_real, names, child_shown)
            except OSError:
                continue  # vanished during the walk
            out.append(info)
            if level < depth and info["type"] == "FILE_TYPE_DIRECTORY" and not info.get("isSymlink"):
                walk(child_real, child_shown, level + 1)

    walk(root, display_root, 1)
    return out


def remove_tree(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path, ignore_errors=False, onerror=_ignore_missing)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _ignore_missing(
    func: object, path: str, exc_info: tuple[type[BaseException], BaseException, object]
) -> None:
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]


class _Watcher:
    """A CreateWatcher watcher: accumulates events until GetWatcherEvents takes them."""

    def __init__(self, watcher: DirWatcher) -> None:
        self.watcher = watcher
        self.events: list[Message] = []
        self.error: EnvdError | None = None

    def fail(self, error: EnvdError) -> None:
        self.error = error

    def add(self, event: Message) -> None:
        if len(self.events) < MAX_WATCHER_EVENTS:
            self.events.append(event)


class FilesystemService:
    def __init__(self, state: SandboxState) -> None:
        self.state = state
        self.watchers: dict[str, _Watcher] = {}

    def routes(self) -> dict[str, object]:
        prefix = "/filesystem.Filesystem/"
        return {
            prefix + "Stat": UnaryEndpoint(self.stat),
            prefix + "MakeDir": UnaryEndpoint(self.make_dir),
            prefix + "Move": UnaryEndpoint(self.move),
            prefix + "ListDir": UnaryEndpoint(self.list_dir),
            prefix + "Remove": UnaryEndpoint(self.remove),
            prefix + "WatchDir": ServerStreamEndpoint(self.watch_dir, _KEEPALIVE),
            prefix + "CreateWatcher": UnaryEndpoint(self.create_watcher),
            prefix + "GetWatcherEvents": UnaryEndpoint(self.get_watcher_events),
            prefix + "RemoveWatcher": UnaryEndpoint(self.remove_watcher),
        }

    def _resolve(self, msg: Message, ctx: CallContext, name: str = "path") -> tuple[str, User]:
        user = self.state.resolve_user(ctx.username)
        return self.state.resolve_path(get_str(msg, name), user), user

    async def stat(self, msg: Message, ctx: CallContext) -> Message:
        path, _ = self._resolve(msg, ctx)
        try:
            return {"entry": entry_info(path)}
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                raise NotFound(f"file not found: '{path}'") from exc
            raise from_os_error(exc, path) from exc

    async def make_dir(self, msg: Message, ctx: CallContext) -> Message:
        path, user = self._resolve(msg, ctx)
        if os.path.lexists(path):
            if os.path.isdir(path):
                raise AlreadyExists(f"directory '{path}' already exists")
            raise InvalidArgument(f"path '{path}' already exists and is not a directory")
        try:
            make_dirs(path, user)
            return {"entry": entry_info(path)}
        except OSError as exc:
            raise from_os_error(exc, path) from exc

    async def move(self, msg: Message, ctx: CallContext) -> Message:
        source, user = self._resolve(msg, ctx, "source")
        destination = self.state.resolve_path(get_str(msg, "destination"), user)
        if not os.path.lexists(source):
            raise NotFound(f"source '{source}' not found")
        try:
            make_dirs(os.path.dirname(destination), user)
            try:
                os.rename(source, destination)
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                await anyio.to_thread.run_sync(shutil.move, source, destination)
            return {"entry": entry_info(destination)}
        except OSError as exc:
            raise from_os_error(exc, source) from exc

    async def list_dir(self, msg: Message, ctx: CallContext) -> Message:
        path, _ = self._resolve(msg, ctx)
        depth = max(get_int(msg, "depth"), 1)
        try:
            real = os.path.realpath(path, strict=True)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                raise NotFound(f"path '{path}' not found") from exc
            if exc.errno == errno.ELOOP:
                raise FailedPrecondition(f"path '{path}' is a symlink loop") from exc
            raise from_os_error(exc, path) from exc
        if not os.path.isdir(real):
            raise InvalidArgument(f"path '{path}' is not a directory")
        entries = await anyio.to_thread.run_sync(list_dir, real, path, depth)
        return {"entries": entries}

    async def remove(self, msg: Message, ctx: CallContext) -> Message:
        path, _ = self._resolve(msg, ctx)
        try:
            await anyio.to_thread.run_sync(remove_tree, path)
        except OSError as exc:
            raise from_os_error(exc, path) from exc
        return {}

    def _watch_args(self, msg: Message, ctx: CallContext) -> tuple[str, bool, bool]:
        path, _ = self._resolve(msg, ctx)
        check_watchable(path, get_bool(msg, "allowNetworkMounts"))
        return path, get_bool(msg, "recursive"), get_bool(msg, "includeEntry")

    async def watch_dir(self, msg: Message, ctx: CallContext) -> AsyncIterator[Message]:
        path, recursive, include_entry = self._watch_args(msg, ctx)
        queue: asyncio.Queue[Message | EnvdError] = asyncio.Queue()
        watcher = DirWatcher(path, recursive, include_entry, queue.put_nowait, queue.put_nowait)
        watcher.start()
        try:
            yield {"start": {}}
            while True:
                item = await queue.get()
                if isinstance(item, EnvdError):
                    raise item
                yield {"filesystem": item}
        finally:
            watcher.close()

    async def create_watcher(self, msg: Message, ctx: CallContext) -> Message:
        path, recursive, include_entry = self._watch_args(msg, ctx)
        holder = _Watcher(
            DirWatcher(path, recursive, include_entry, lambda e: holder.add(e), lambda x: holder.fail(x))
        )
        holder.watcher.start()
        watcher_id = "w" + uuid.uuid4().hex[:16]
        self.watchers[watcher_id] = holder
        return {"watcherId": watcher_id}

    def _watcher(self, msg: Message) -> tuple[str, _Watcher]:
        watcher_id = get_str(msg, "watcherId")
        holder = self.watchers.get(watcher_id)
        if holder is None:
            raise NotFound(f"watcher '{watcher_id}' not found")
        return watcher_id, holder

    async def get_watcher_events(self, msg: Message, ctx: CallContext) -> Message:
        _, holder = self._watcher(msg)
        if holder.error is not None:
            raise holder.error
        events, holder.events = holder.events, []
        return {"events": events}

    async def remove_watcher(self, msg: Message, ctx: CallContext) -> Message:
        watcher_id, holder = self._watcher(msg)
        holder.watcher.close()
        del self.watchers[watcher_id]
        return {}

    def close(self) -> None:
        for holder in self.watchers.values():
            holder.watcher.close()
        self.watchers.clear()

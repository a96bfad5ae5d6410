"""inotify watcher: op splitting, recursion, mounts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from inotify_simple import flags as F

from aenv.envd.errors import InvalidArgument, NotFound
from aenv.envd.watch import DirWatcher, check_watchable, mount_fstype, split_ops


def test_split_order() -> None:
    mask = F.CREATE | F.MODIFY | F.ATTRIB | F.DELETE | F.MOVED_FROM
    assert split_ops(mask) == [
        "EVENT_TYPE_CREATE",
        "EVENT_TYPE_RENAME",
        "EVENT_TYPE_CHMOD",
        "EVENT_TYPE_WRITE",
        "EVENT_TYPE_REMOVE",
    ]
    assert split_ops(F.MOVED_TO) == ["EVENT_TYPE_CREATE"]
    assert split_ops(F.OPEN) == []


def test_mount_fstype_longest_prefix(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(
        "22 1 0:21 / / rw - overlay overlay rw\n30 22 0:40 / /mnt/share rw,relatime - nfs4 srv:/x rw\n"
    )
    assert mount_fstype("/mnt/share/a", str(info)) == "nfs4"
    assert mount_fstype("/mnt/shared", str(info)) == "overlay"
    assert mount_fstype("/", str(info)) == "overlay"


def test_check_watchable(tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        check_watchable(str(tmp_path / "missing"), False)
    (tmp_path / "f").write_text("")
    with pytest.raises(InvalidArgument):
        check_watchable(str(tmp_path / "f"), False)
    check_watchable(str(tmp_path), False)


async def _until(events: list[dict], predicate) -> None:  # type: ignore[no-untyped-def,type-arg]
    for _ in range(400):
        if predicate(events):
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"events never matched: {events}")


async def test_recursive_watch_follows_new_subdirs(tmp_path: Path) -> None:
    events: list[dict] = []  # type: ignore[type-arg]
    watcher = DirWatcher(str(tmp_path), recursive=True, include_entry=True, on_event=events.append)
    watcher.start()
    try:
        (tmp_path / "sub").mkdir()
        await _until(events, lambda ev: any(e["name"] == "sub" for e in ev))
        (tmp_path / "sub" / "f.txt").write_text("x")
        await _until(
            events, lambda ev: any(e["name"] == "sub/f.txt" and e["type"] == "EVENT_TYPE_WRITE" for e in ev)
        )
        (tmp_path / "sub" / "f.txt").rename(tmp_path / "g.txt")
        await _until(events, lambda ev: any(e["name"] == "g.txt" for e in ev))
    finally:
        watcher.close()
    created = next(e for e in events if e["name"] == "sub/f.txt" and e["type"] == "EVENT_TYPE_CREATE")
    assert created["entry"]["path"] == str(tmp_path / "sub" / "f.txt")
    assert any(e["name"] == "sub/f.txt" and e["type"] == "EVENT_TYPE_RENAME" for e in events)
    assert any(e["name"] == "g.txt" and e["type"] == "EVENT_TYPE_CREATE" for e in events)


async def test_non_recursive_ignores_subdir_content(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    events: list[dict] = []  # type: ignore[type-arg]
    watcher = DirWatcher(str(tmp_path), recursive=False, include_entry=False, on_event=events.append)
    watcher.start()
    try:
        (tmp_path / "sub" / "hidden.txt").write_text("x")
        (tmp_path / "top.txt").write_text("x")
        await _until(events, lambda ev: any(e["name"] == "top.txt" for e in ev))
    finally:
        watcher.close()
    assert not any("hidden" in e["name"] for e in events)
    assert all("entry" not in e for e in events)


async def test_queue_overflow_fails_the_watch(tmp_path: Path) -> None:
    from inotify_simple import Event

    from aenv.envd.errors import EnvdError

    errors: list[EnvdError] = []
    watcher = DirWatcher(
        str(tmp_path), recursive=False, include_entry=False, on_event=lambda e: None, on_error=errors.append
    )
    watcher.start()
    assert watcher._inotify is not None
    watcher._inotify.read = lambda timeout=None: [Event(-1, F.Q_OVERFLOW, 0, "")]
    watcher._on_readable()
    assert [e.code for e in errors] == ["internal"]
    assert watcher._inotify is None  # closed


async def test_content_of_a_new_dir_made_before_its_watch_is_reported(tmp_path: Path) -> None:
    """`mkdir -p a/b && echo > a/b/f` in one go: the watcher only learns about `a` afterwards (the
    loop has not run yet), so `a/b` and `a/b/f` exist before any watch on them. They must still be
    reported as created, with their entries."""
    events: list[dict] = []  # type: ignore[type-arg]
    watcher = DirWatcher(str(tmp_path), recursive=True, include_entry=True, on_event=events.append)
    watcher.start()
    try:
        (tmp_path / "a" / "b").mkdir(parents=True)
        (tmp_path / "a" / "b" / "f.txt").write_text("x")
        await _until(events, lambda ev: any(e["name"] == "a/b/f.txt" for e in ev))
        (tmp_path / "a" / "b" / "later.txt").write_text("y")  # and the new watches are live
        await _until(events, lambda ev: any(e["name"] == "a/b/later.txt" for e in ev))
    finally:
        watcher.close()
    names = [e["name"] for e in events if e["type"] == "EVENT_TYPE_CREATE"]
    assert names.index("a") < names.index("a/b") < names.index("a/b/f.txt")
    created = next(e for e in events if e["name"] == "a/b/f.txt")
    assert created["entry"]["path"] == str(tmp_path / "a" / "b" / "f.txt")

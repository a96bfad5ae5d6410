"""The volume content API's file operations: E2B's semantics (force, parents, depth) and, since a
sandbox may have written anything into a volume, no symlink is ever followed out of it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aenv.errors import Conflict, InvalidRequest, NotFound
from aenv.runtime.volume_files import Owner, VolumeDir, normalize


@pytest.fixture
def vol(tmp_path: Path) -> VolumeDir:
    (tmp_path / "vol").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_text("host file")
    return VolumeDir(tmp_path / "vol")


def _write(vol: VolumeDir, path: str, data: bytes, force: bool = False, owner: Owner | None = None) -> dict[str, object]:
    pending = vol.begin_write(path, force)
    pending.write(data)
    return pending.commit(owner or Owner())


def _read(vol: VolumeDir, path: str) -> bytes:
    fd = vol.open_read(path)
    try:
        return os.read(fd, 1 << 20)
    finally:
        os.close(fd)


def test_normalize_never_climbs() -> None:
    assert normalize("a/b/../c") == "/a/c"
    assert normalize("/../../etc") == "/etc"
    assert normalize("") == "/"
    with pytest.raises(InvalidRequest):
        normalize("/a\x00b")


def test_write_read_force_and_parents(vol: VolumeDir) -> None:
    entry = _write(vol, "/a.txt", b"one", owner=Owner(uid=1000, gid=1000, mode=0o600))
    assert (entry["type"], entry["size"], entry["mode"], entry["uid"]) == ("file", 3, 0o600, 1000)
    with pytest.raises(Conflict):
        vol.begin_write("/a.txt", force=False)
    _write(vol, "/a.txt", b"two", force=True)
    assert _read(vol, "a.txt") == b"two"
    with pytest.raises(NotFound):
        vol.begin_write("/missing/a.txt", force=True)
    assert not [p for p in os.listdir(vol.root) if p.startswith(".aenv-upload")]  # no temp file left


def test_an_aborted_upload_leaves_nothing(vol: VolumeDir) -> None:
    pending = vol.begin_write("/big", force=False)
    pending.write(b"x" * 100)
    pending.abort()
    assert os.listdir(vol.root) == []


def test_dirs_list_and_remove(vol: VolumeDir) -> None:
    vol.make_dir("/d/e/f", Owner(mode=0o700), force=True)
    assert vol.stat("/d/e/f")["mode"] == 0o700
    with pytest.raises(Conflict):
        vol.make_dir("/d", Owner(), force=False)
    assert vol.make_dir("/d", Owner(), force=True)["type"] == "directory"
    with pytest.raises(NotFound):
        vol.make_dir("/x/y", Owner(), force=False)
    _write(vol, "/d/file", b"")
    assert [e["path"] for e in vol.listdir("/d")] == ["/d/e", "/d/file"]
    assert [e["path"] for e in vol.listdir("/", depth=3)] == ["/d", "/d/e", "/d/e/f", "/d/file"]
    with pytest.raises(NotFound):
        vol.listdir("/nope")
    vol.remove("/d")
    assert vol.listdir("/") == []
    with pytest.raises(NotFound):
        vol.remove("/d")
    with pytest.raises(InvalidRequest):
        vol.remove("/")


def test_symlinks_are_entries_never_followed(vol: VolumeDir, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    os.symlink(outside / "secret", vol.root / "link")
    os.symlink(outside, vol.root / "dirlink")
    entry = vol.stat("/link")
    assert entry["type"] == "symlink" and entry["target"] == str(outside / "secret")
    with pytest.raises(InvalidRequest, match="not a regular file"):
        _read(vol, "/link")
    with pytest.raises(NotFound):
        _read(vol, "/dirlink/secret")
    with pytest.raises(NotFound):
        vol.begin_write("/dirlink/new", force=True)
    with pytest.raises(NotFound):
        vol.listdir("/dirlink")
    (outside / "secret").chmod(0o644)
    vol.update("/link", Owner(mode=0o600))  # a symlink keeps its mode, the target is untouched
    assert (outside / "secret").stat().st_mode & 0o777 == 0o644
    vol.remove("/dirlink")
    assert (outside / "secret").read_text() == "host file"
    _write(vol, "/link", b"replaced", force=True)  # the link is replaced, the target is not written
    assert (outside / "secret").read_text() == "host file"
    assert _read(vol, "/link") == b"replaced"


def test_a_fifo_is_never_opened(vol: VolumeDir) -> None:
    os.mkfifo(vol.root / "pipe")  # opening it for reading would block the server's thread
    with pytest.raises(InvalidRequest, match="regular file"):
        vol.open_read("/pipe")
    with pytest.raises(InvalidRequest, match="directory"):
        vol.open_read("/")

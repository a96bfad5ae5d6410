"""EntryInfo construction and Go-style formatting."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from aenv.envd.entry import entry_info, go_permissions, rfc3339_ns


def test_go_permissions() -> None:
    assert go_permissions(stat.S_IFREG | 0o644) == "-rw-r--r--"
    assert go_permissions(stat.S_IFDIR | 0o755) == "drwxr-xr-x"
    assert go_permissions(stat.S_IFLNK | 0o777) == "Lrwxrwxrwx"
    assert go_permissions(stat.S_IFDIR | stat.S_ISVTX | 0o777) == "dtrwxrwxrwx"
    assert go_permissions(stat.S_IFREG | stat.S_ISUID | 0o755) == "urwxr-xr-x"
    assert go_permissions(stat.S_IFCHR | 0o666) == "Dcrw-rw-rw-"
    assert go_permissions(stat.S_IFIFO | 0o600) == "prw-------"


def test_rfc3339_fraction_digits() -> None:
    assert rfc3339_ns(0) == "1970-01-01T00:00:00Z"
    assert rfc3339_ns(1_500_000_000) == "1970-01-01T00:00:01.500Z"
    assert rfc3339_ns(1_000_123_000) == "1970-01-01T00:00:01.000123Z"
    assert rfc3339_ns(1_000_000_001) == "1970-01-01T00:00:01.000000001Z"


def test_regular_file(tmp_path: Path) -> None:
    f = tmp_path / "a.txt"
    f.write_text("hello")
    os.chmod(f, 0o640)
    info = entry_info(str(f))
    assert info["name"] == "a.txt"
    assert info["type"] == "FILE_TYPE_FILE"
    assert info["path"] == str(f)
    assert info["size"] == "5"
    assert info["mode"] == 0o640
    assert info["permissions"] == "-rw-r-----"
    assert info["modifiedTime"].endswith("Z")
    assert "symlinkTarget" not in info and "isSymlink" not in info


def test_symlink_reports_target(tmp_path: Path) -> None:
    d = tmp_path / "dir"
    d.mkdir(mode=0o750)
    os.chmod(d, 0o750)
    link = tmp_path / "ln"
    link.symlink_to("dir")
    info = entry_info(str(link))
    assert info["type"] == "FILE_TYPE_DIRECTORY"
    assert info["isSymlink"] is True
    assert info["symlinkTarget"] == str(d)
    assert info["mode"] == 0o750
    assert info["permissions"].startswith("L")


def test_broken_symlink_is_unspecified(tmp_path: Path) -> None:
    link = tmp_path / "broken"
    link.symlink_to("missing")
    info = entry_info(str(link))
    assert info["type"] == "FILE_TYPE_UNSPECIFIED"
    assert info["symlinkTarget"] == str(link)
    assert info["isSymlink"] is True


def test_special_files_are_unspecified(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    info = entry_info(str(fifo))
    assert info["type"] == "FILE_TYPE_UNSPECIFIED"
    assert info["permissions"].startswith("p")


def test_display_path_kept(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    info = entry_info(str(tmp_path / "f"), display_path="/via/link/f")
    assert info["path"] == "/via/link/f" and info["name"] == "f"


def test_metadata_from_xattrs(tmp_path: Path) -> None:
    f = tmp_path / "m"
    f.write_text("")
    try:
        os.setxattr(f, "user.e2b.owner", b"alice")
        os.setxattr(f, "user.other", b"x")
    except OSError:
        import pytest

        pytest.skip("no user xattrs here")
    assert entry_info(str(f))["metadata"] == {"owner": "alice"}


def test_directory_sizes_read_as_on_e2b_ext4_root() -> None:
    """A directory of the root filesystem is whole blocks, at least one (ext4, E2B's root), whatever
    the overlay under it reports; other entries and other filesystems keep their lstat size."""
    import os
    import stat as st_mod

    from aenv.envd.entry import entry_size

    root_dev = os.stat("/").st_dev

    def fake(mode: int, size: int, dev: int) -> os.stat_result:
        return os.stat_result((mode, 1, dev, 1, 0, 0, size, 0, 0, 0), {"st_blksize": 4096})

    d = st_mod.S_IFDIR | 0o755
    assert entry_size(fake(d, 0, root_dev)) == 4096  # an empty btrfs directory under overlay
    assert entry_size(fake(d, 22, root_dev)) == 4096
    assert entry_size(fake(d, 4096, root_dev)) == 4096  # ext4 (the vm root): unchanged
    assert entry_size(fake(d, 5000, root_dev)) == 8192
    assert entry_size(fake(d, 40, root_dev + 1)) == 40  # a tmpfs elsewhere: as it is
    assert entry_size(fake(st_mod.S_IFREG | 0o644, 0, root_dev)) == 0
    assert entry_size(fake(st_mod.S_IFREG | 0o644, 5, root_dev)) == 5

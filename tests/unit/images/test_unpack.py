from __future__ import annotations

import os
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest

from aenv.images.errors import DigestMismatch, UnsafeLayer
from aenv.images.unpack import OVERLAY_OPAQUE_XATTR, unpack_layer
from tests.fixtures.fakes import gz, make_tar, sha, ti

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="mknod/chown/trusted xattrs need root")


def write(tmp: Path, data: bytes, name: str = "layer") -> Path:
    p = tmp / name
    p.write_bytes(data)
    return p


def base_layer() -> bytes:
    return make_tar(
        [
            (ti("etc", tarfile.DIRTYPE, 0o755), None),
            (ti("etc/motd"), b"hi"),
            (ti("etc/keep"), b"k"),
            (ti("opt", tarfile.DIRTYPE, 0o755), None),
            (ti("opt/old.txt"), b"old"),
            (ti("usr", tarfile.DIRTYPE, 0o755), None),
            (ti("usr/bin", tarfile.DIRTYPE, 0o755), None),
            (ti("usr/bin/tool", mode=0o4755, uid=0, gid=0), b"#!/bin/sh\n"),
            (ti("bin", tarfile.SYMTYPE, 0o777, linkname="usr/bin"), None),
        ]
    )


def top_layer() -> bytes:
    return make_tar(
        [
            (ti("etc", tarfile.DIRTYPE, 0o755), None),
            (ti("etc/.wh.motd"), b""),
            (ti("opt", tarfile.DIRTYPE, 0o755), None),
            (ti("opt/.wh..wh..opq"), b""),
            (ti("opt/new.txt"), b"new"),
            (ti("opt/link.txt", tarfile.LNKTYPE, linkname="opt/new.txt"), None),
        ]
    )


def test_apply_mode_whiteouts_opaque_hardlinks(tmp_path: Path) -> None:
    dest = tmp_path / "root"
    unpack_layer(write(tmp_path, gz(base_layer()), "l1"), dest, mode="apply")
    assert (dest / "bin").is_symlink() and os.readlink(dest / "bin") == "usr/bin"
    assert stat.S_IMODE((dest / "usr/bin/tool").stat().st_mode) == 0o4755
    unpack_layer(write(tmp_path, top_layer(), "l2"), dest, mode="apply")
    assert not (dest / "etc/motd").exists() and (dest / "etc/keep").exists()
    assert sorted(os.listdir(dest / "opt")) == ["link.txt", "new.txt"]  # opaque removed old.txt only
    assert (dest / "opt/link.txt").stat().st_ino == (dest / "opt/new.txt").stat().st_ino


@needs_root
def test_overlay_mode_translates_whiteouts(tmp_path: Path) -> None:
    dest = tmp_path / "l2"
    unpack_layer(write(tmp_path, top_layer()), dest, mode="overlay")
    st = os.lstat(dest / "etc/motd")
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0
    assert os.getxattr(dest / "opt", OVERLAY_OPAQUE_XATTR) == b"y"
    assert not (dest / "opt/.wh..wh..opq").exists()


@needs_root
def test_overlay_mount_of_two_layers(tmp_path: Path) -> None:
    """The real consumer: overlayfs must see the whiteouts and the opaque dir."""
    l1, l2, mnt = tmp_path / "l1", tmp_path / "l2", tmp_path / "mnt"
    unpack_layer(write(tmp_path, gz(base_layer()), "b1"), l1)
    unpack_layer(write(tmp_path, top_layer(), "b2"), l2)
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o", f"ro,lowerdir={l2}:{l1}", str(mnt)], capture_output=True
    )
    if r.returncode != 0:
        pytest.skip(f"overlay mount unavailable: {r.stderr!r}")
    try:
        assert not (mnt / "etc/motd").exists() and (mnt / "etc/keep").read_text() == "k"
        assert sorted(os.listdir(mnt / "opt")) == ["link.txt", "new.txt"]
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@needs_root
def test_devices_ownership_xattrs(tmp_path: Path) -> None:
    t = ti("dev/null", tarfile.CHRTYPE, 0o666, devmajor=1, devminor=3)
    f = ti("f", uid=1000, gid=1000, pax_headers={"SCHILY.xattr.user.note": "hi"})
    data = make_tar(
        [
            (ti("dev", tarfile.DIRTYPE, 0o755), None),
            (t, None),
            (f, b"x"),
            (ti("fifo", tarfile.FIFOTYPE, 0o600), None),
        ]
    )
    dest = tmp_path / "d"
    unpack_layer(write(tmp_path, data), dest)
    st = os.lstat(dest / "dev/null")
    assert stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == 1 and os.minor(st.st_rdev) == 3
    assert (os.stat(dest / "f").st_uid, os.stat(dest / "f").st_gid) == (1000, 1000)
    try:
        assert os.getxattr(dest / "f", "user.note") == b"hi"
    except OSError:
        pytest.skip("filesystem without user xattrs")
    assert stat.S_ISFIFO(os.lstat(dest / "fifo").st_mode)


@pytest.mark.parametrize(
    ("entries", "why"),
    [
        ([(ti("../evil"), b"x")], "escapes"),
        ([(ti("a/../../evil"), b"x")], "escapes"),
        ([(ti("/etc/passwd"), b"x")], "absolute"),
        ([(ti("link", tarfile.SYMTYPE, linkname="/etc"), None), (ti("link/passwd"), b"x")], "symlink"),
        ([(ti("up", tarfile.SYMTYPE, linkname=".."), None), (ti("up/x"), b"x")], "symlink"),
        ([(ti("h", tarfile.LNKTYPE, linkname="../../etc/passwd"), None)], "escapes"),
        ([(ti("h", tarfile.LNKTYPE, linkname="/etc/passwd"), None)], "absolute"),
        (
            [
                (ti("l", tarfile.SYMTYPE, linkname="/etc"), None),
                (ti("h", tarfile.LNKTYPE, linkname="l/passwd"), None),
            ],
            "symlink",
        ),
        ([(ti(".wh.."), b"")], "escapes|malformed"),
    ],
)
def test_escapes_are_refused(tmp_path: Path, entries: list, why: str) -> None:
    outside = tmp_path / "evil"
    with pytest.raises(UnsafeLayer, match=why) as e:
        unpack_layer(write(tmp_path, make_tar(entries)), tmp_path / "d", reference="img:1")
    assert "img:1" in str(e.value)
    assert not outside.exists()


def test_zstd_and_diff_id(tmp_path: Path) -> None:
    import zstandard

    raw = make_tar([(ti("a.txt"), b"zz")])
    blob = write(tmp_path, zstandard.ZstdCompressor().compress(raw))
    stats = unpack_layer(blob, tmp_path / "d", expected_diff_id=sha(raw))
    assert (tmp_path / "d/a.txt").read_bytes() == b"zz"
    assert stats.diff_id == sha(raw) and stats.bytes == len(raw) and stats.entries == 1
    with pytest.raises(DigestMismatch):
        unpack_layer(blob, tmp_path / "e", expected_diff_id="sha256:" + "0" * 64)


def test_replace_dir_with_file_and_back(tmp_path: Path) -> None:
    dest = tmp_path / "d"
    unpack_layer(
        write(tmp_path, make_tar([(ti("x", tarfile.DIRTYPE, 0o755), None), (ti("x/y"), b"1")]), "a"),
        dest,
        mode="apply",
    )
    unpack_layer(write(tmp_path, make_tar([(ti("x"), b"file")]), "b"), dest, mode="apply")
    assert (dest / "x").read_bytes() == b"file"
    unpack_layer(
        write(tmp_path, make_tar([(ti("x", tarfile.DIRTYPE, 0o700), None)]), "c"), dest, mode="apply"
    )
    assert (dest / "x").is_dir()

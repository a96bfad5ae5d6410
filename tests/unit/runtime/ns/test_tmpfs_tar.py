"""CRIU's ``tar`` (``tmpfs_tar.py``): an empty tmpfs is archived byte for byte as the real ``tar``
archives it and put back as the real one would put it back (mode, owner, mtime of the mount's root);
anything else goes to the real one."""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from aenv.runtime.ns import tmpfs_tar

EXTRACT = ["--extract", "--gzip", "--no-unquote", "--no-wildcards", "--directory"]  # CRIU's command lines
CREATE = ["--create", "--gzip", "--no-unquote", "--no-wildcards", "--one-file-system", "--check-links",
          "--preserve-permissions", "--sparse", "--numeric-owner", "--directory"]


@pytest.fixture
def shim(tmp_path: Path) -> Path:
    (tmp_path / "base").mkdir()
    directory = tmpfs_tar.shim_dir(tmp_path / "base")
    if directory is None:
        pytest.skip("no C compiler, static zlib or tar here: CRIU runs the real tar")
    assert sorted(p.name for p in directory.iterdir()) == ["tar"]  # alone on the front of PATH
    return directory / "tar"


def _archive(src: Path, image: Path, exe: Path | str = "tar", create: list[str] = CREATE,
             env: dict[str, str] | None = None) -> None:
    with image.open("wb") as out:  # as CRIU dumps a tmpfs: the mount's directory on stdin
        fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY)
        try:
            subprocess.run([str(exe), *create, "/proc/self/fd/0", "."], stdin=fd, stdout=out, check=True, env=env)
        finally:
            os.close(fd)


def _tmpfs_like(path: Path, uid: int = 1234, gid: int = 5678) -> Path:
    path.mkdir()
    if os.geteuid() == 0:
        os.chown(path, uid, gid)
    path.chmod(0o1777)
    os.utime(path, (1000, 123456789))
    return path


def _extract(exe: Path | str, image: Path, dest: Path) -> None:
    dest.mkdir()
    with image.open("rb") as stdin:
        subprocess.run([str(exe), *EXTRACT, str(dest)], stdin=stdin, check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="tar restores the owner as root only")
def test_an_empty_tmpfs_comes_back_as_tar_puts_it(tmp_path: Path, shim: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    os.chown(src, 1234, 5678)
    src.chmod(0o1777)
    os.utime(src, (1000, 123456789))
    _archive(src, tmp_path / "img")
    _extract(shim, tmp_path / "img", tmp_path / "shim")
    _extract("tar", tmp_path / "img", tmp_path / "real")
    got, want = (tmp_path / "shim").stat(), (tmp_path / "real").stat()
    assert (got.st_mode, got.st_uid, got.st_gid, got.st_mtime) == (want.st_mode, want.st_uid, want.st_gid,
                                                                    want.st_mtime)
    assert (got.st_mode & 0o7777, got.st_uid, got.st_mtime) == (0o1777, 1234, 123456789)


def test_a_tmpfs_with_files_goes_to_the_real_tar(tmp_path: Path, shim: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "f").write_text("kept")
    _archive(src, tmp_path / "img")
    _extract(shim, tmp_path / "img", tmp_path / "out")
    assert (tmp_path / "out" / "sub" / "f").read_text() == "kept"


def test_an_archive_on_a_pipe_goes_to_the_real_tar(tmp_path: Path, shim: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("piped")
    _archive(src, tmp_path / "img")
    (tmp_path / "out").mkdir()
    subprocess.run([str(shim), *EXTRACT, str(tmp_path / "out")], input=(tmp_path / "img").read_bytes(), check=True)
    assert (tmp_path / "out" / "f").read_text() == "piped"


def test_an_empty_tmpfs_is_archived_byte_for_byte_as_tar_does(tmp_path: Path, shim: Path) -> None:
    src = _tmpfs_like(tmp_path / "src")
    _archive(src, tmp_path / "shim.img", shim, env={"PATH": "/nonexistent"})  # no gzip to exec: done in-process
    _archive(src, tmp_path / "real.img")
    ours, theirs = gzip.decompress((tmp_path / "shim.img").read_bytes()), gzip.decompress((tmp_path / "real.img").read_bytes())
    assert len(ours) == 10240 and ours == theirs
    for exe in (shim, "tar"):  # and both ends put it back alike
        _extract(exe, tmp_path / "shim.img", tmp_path / f"out-{Path(exe).name}-{id(exe)}")
    got = [p.stat() for p in tmp_path.glob("out-*")]
    assert {(st.st_mode, st.st_uid, st.st_gid, st.st_mtime) for st in got} == {
        (src.stat().st_mode, src.stat().st_uid, src.stat().st_gid, 123456789)}


def test_a_tmpfs_with_anything_in_it_is_archived_by_the_real_tar(tmp_path: Path, shim: Path) -> None:
    src = _tmpfs_like(tmp_path / "src")
    (src / ".hidden").write_text("kept")
    _archive(src, tmp_path / "img", shim)
    _extract("tar", tmp_path / "img", tmp_path / "out")
    assert (tmp_path / "out" / ".hidden").read_text() == "kept"


@pytest.mark.skipif(os.geteuid() != 0, reason="a uid beyond tar's octal field needs chown")
def test_an_owner_beyond_the_octal_field_is_archived_by_the_real_tar(tmp_path: Path, shim: Path) -> None:
    src = _tmpfs_like(tmp_path / "src", uid=1_200_000_000, gid=1_200_000_000)  # a mapped uid: base-256 in tar
    _archive(src, tmp_path / "shim.img", shim)
    _archive(src, tmp_path / "real.img")
    assert gzip.decompress((tmp_path / "shim.img").read_bytes()) == gzip.decompress((tmp_path / "real.img").read_bytes())


def test_another_create_command_line_goes_to_the_real_tar(tmp_path: Path, shim: Path) -> None:
    src = _tmpfs_like(tmp_path / "src")
    uname = [c for c in CREATE if c != "--numeric-owner"]  # the real tar then names the owner; the program would not
    _archive(src, tmp_path / "shim.img", shim, uname)
    _archive(src, tmp_path / "real.img", "tar", uname)
    assert gzip.decompress((tmp_path / "shim.img").read_bytes()) == gzip.decompress((tmp_path / "real.img").read_bytes())


def test_criu_env_puts_the_program_first(tmp_path: Path, shim: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    env = tmpfs_tar.criu_env(tmp_path / "base")
    assert env is not None and env["PATH"] == f"{shim.parent}:/usr/bin:/bin"
    assert shutil.which("tar", path=env["PATH"]) == str(shim)


def test_a_tar_path_that_would_break_the_source_is_refused() -> None:
    with pytest.raises(ValueError, match="quote"):
        tmpfs_tar.source('/bin/t"ar')

"""The restore's ``tar`` (``tmpfs_tar.py``): an archive of an empty tmpfs is put back as the real
``tar`` would put it back (mode, owner, mtime of the mount's root), anything else goes to the real one."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from aenv.runtime.ns import tmpfs_tar

EXTRACT = ["--extract", "--gzip", "--no-unquote", "--no-wildcards", "--directory"]  # CRIU's command line


@pytest.fixture
def shim(tmp_path: Path) -> Path:
    (tmp_path / "base").mkdir()
    directory = tmpfs_tar.shim_dir(tmp_path / "base")
    if directory is None:
        pytest.skip("no C compiler, static zlib or tar here: CRIU runs the real tar")
    assert sorted(p.name for p in directory.iterdir()) == ["tar"]  # alone on the front of PATH
    return directory / "tar"


def _archive(src: Path, image: Path) -> None:
    with image.open("wb") as out:  # as CRIU dumps a tmpfs
        subprocess.run(["tar", "--create", "--gzip", "--no-unquote", "--no-wildcards", "--one-file-system",
                        "--check-links", "--preserve-permissions", "--sparse", "--numeric-owner",
                        "--directory", str(src), "."], stdout=out, check=True)


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


def test_restore_env_puts_the_program_first(tmp_path: Path, shim: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    env = tmpfs_tar.restore_env(tmp_path / "base")
    assert env is not None and env["PATH"] == f"{shim.parent}:/usr/bin:/bin"
    assert shutil.which("tar", path=env["PATH"]) == str(shim)


def test_a_tar_path_that_would_break_the_source_is_refused() -> None:
    with pytest.raises(ValueError, match="quote"):
        tmpfs_tar.source('/bin/t"ar')

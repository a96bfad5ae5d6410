"""COPY to a relative destination lands under the step's working directory, as Docker's and E2B's."""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

from aenv.core.build_spec import Step, copy_script

HASH = "b" * 64


def _archive(tmp: Path) -> Path:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("folder/test.txt")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"data"))
        link = tarfile.TarInfo("folder/symlink.txt")
        link.type, link.linkname = tarfile.SYMTYPE, "test.txt"
        tar.addfile(link)
    path = tmp / "upload.tar"
    path.write_bytes(buf.getvalue())
    return path


def _copy(tmp: Path, src: str, dest: str) -> subprocess.CompletedProcess[str]:
    workdir = tmp / "work"
    workdir.mkdir(exist_ok=True)
    script = copy_script(Step("COPY", (src, dest), HASH), str(_archive(tmp)))
    return subprocess.run(["/bin/sh", "-c", script], cwd=workdir, capture_output=True, text=True, check=False)


def test_a_pattern_copied_to_its_own_relative_path(tmp_path: Path) -> None:
    """The E2B SDK's test_build_template: ``copy("folder/*", "folder")`` then ``cat folder/test.txt``
    (it was copied onto itself inside the unpacked upload: 'are the same file')."""
    res = _copy(tmp_path, "folder/*", "folder")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "work" / "folder" / "test.txt").read_text() == "data"
    assert (tmp_path / "work" / "folder" / "symlink.txt").is_symlink()


def test_one_file_to_a_relative_path_and_an_absolute_one(tmp_path: Path) -> None:
    res = _copy(tmp_path, "folder/symlink.txt", "folder/symlink.txt")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "work" / "folder" / "symlink.txt").is_symlink()
    res = _copy(tmp_path, "folder/test.txt", str(tmp_path / "abs" / "t.txt"))
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "abs" / "t.txt").read_text() == "data"

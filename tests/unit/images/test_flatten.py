from __future__ import annotations

import os
import tarfile
from pathlib import Path

import pytest

from aenv.images.flatten import flatten_layers
from aenv.images.unpack import unpack_layer
from tests.fixtures.fakes import make_tar, ti

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="overlay whiteouts need root")


def test_flatten_matches_overlay_semantics(tmp_path: Path) -> None:
    l1 = make_tar(
        [
            (ti("etc", tarfile.DIRTYPE, 0o755), None),
            (ti("etc/motd"), b"hi"),
            (ti("etc/keep"), b"k"),
            (ti("opt", tarfile.DIRTYPE, 0o755), None),
            (ti("opt/old"), b"o"),
            (ti("bin", tarfile.SYMTYPE, 0o777, linkname="usr/bin"), None),
            (ti("tool", mode=0o4755, uid=0, gid=0), b"#!"),
        ]
    )
    l2 = make_tar(
        [
            (ti("etc", tarfile.DIRTYPE, 0o755), None),
            (ti("etc/.wh.motd"), b""),
            (ti("opt", tarfile.DIRTYPE, 0o711), None),
            (ti("opt/.wh..wh..opq"), b""),
            (ti("opt/new"), b"n"),
            (ti("opt/hard", tarfile.LNKTYPE, linkname="opt/new"), None),
            (ti("home", tarfile.DIRTYPE, 0o755), None),
            (ti("home/user", tarfile.DIRTYPE, 0o750, uid=1000, gid=1000), None),
        ]
    )
    lowers = []
    for i, data in enumerate((l1, l2)):
        (tmp_path / f"b{i}").write_bytes(data)
        unpack_layer(tmp_path / f"b{i}", tmp_path / f"l{i}")
        lowers.insert(0, tmp_path / f"l{i}")
    out = flatten_layers(lowers, tmp_path / "root")
    assert not (out / "etc/motd").exists() and (out / "etc/keep").read_text() == "k"
    assert sorted(os.listdir(out / "opt")) == ["hard", "new"]
    assert (out / "opt/hard").stat().st_ino == (out / "opt/new").stat().st_ino
    assert oct((out / "opt").stat().st_mode & 0o7777) == "0o711"
    assert os.readlink(out / "bin") == "usr/bin"
    assert (out / "tool").stat().st_mode & 0o4000
    assert (out / "home/user").stat().st_uid == 1000
    assert not list(tmp_path.glob(".tmp-*"))

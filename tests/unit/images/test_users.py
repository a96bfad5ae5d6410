from __future__ import annotations

import os
from pathlib import Path

from aenv.images.lookup import lookup
from aenv.images.users import needs_user_layer, write_user_layer


def test_lookup_through_layers_and_symlinked_bin(tmp_path: Path) -> None:
    low, top = tmp_path / "low", tmp_path / "top"
    (low / "usr/bin").mkdir(parents=True)
    (low / "usr/bin/bash").write_text("")
    (low / "bin").symlink_to("usr/bin")
    (low / "etc").mkdir()
    (low / "etc/gone").write_text("")
    (top / "etc").mkdir(parents=True)
    (top / "etc/.wh.gone").write_text("")  # non-root representation of a whiteout
    assert lookup([top, low], "/bin/bash") == low / "usr/bin/bash"
    assert lookup([top, low], "etc/gone") is None
    assert lookup([top, low], "nope") is None


def test_user_layer_added_for_busybox_like_image(tmp_path: Path) -> None:
    img = tmp_path / "img"
    (img / "etc").mkdir(parents=True)
    (img / "bin").mkdir()
    (img / "bin/sh").write_text("")
    (img / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    out = tmp_path / "user-layer"
    assert write_user_layer([img], out)
    passwd = (out / "etc/passwd").read_text().splitlines()
    assert passwd == ["root:x:0:0:root:/root:/bin/sh", "user:x:1000:1000::/home/user:/bin/sh"]
    assert "user:x:1000:" in (out / "etc/group").read_text()
    assert (out / "home/user").is_dir()
    if os.geteuid() == 0:
        assert (out / "home/user").stat().st_uid == 1000
    assert not needs_user_layer([out, img])


def test_no_passwd_at_all(tmp_path: Path) -> None:
    img = tmp_path / "img"
    img.mkdir()
    out = tmp_path / "u"
    assert write_user_layer([img], out)
    assert (out / "etc/passwd").read_text().startswith("root:x:0:0")


def test_existing_user_needs_nothing(tmp_path: Path) -> None:
    img = tmp_path / "img"
    (img / "etc").mkdir(parents=True)
    (img / "home/user").mkdir(parents=True)
    (img / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/bash\n")
    assert not write_user_layer([img], tmp_path / "u")
    assert not (tmp_path / "u").exists()


def test_user_goes_before_another_uid_1000(tmp_path: Path) -> None:
    """Alpine-style image with uid 1000 taken: `user` is inserted first so uid 1000 maps to it."""
    img = tmp_path / "img"
    (img / "etc").mkdir(parents=True)
    (img / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\nqs:x:1000:1000::/home/qs:/bin/sh\n")
    (img / "etc/group").write_text("root:x:0:\nqs:x:1000:\n")
    out = tmp_path / "u"
    write_user_layer([img], out)
    assert [ln.split(":")[0] for ln in (out / "etc/passwd").read_text().splitlines()] == [
        "root",
        "user",
        "qs",
    ]
    assert [ln.split(":")[0] for ln in (out / "etc/group").read_text().splitlines()] == ["root", "user", "qs"]

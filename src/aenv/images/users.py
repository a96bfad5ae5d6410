"""The ``user`` account every sandbox expects (uid 1000, ``/home/user``), added as a tiny top layer.

E2B runs commands as ``user`` by default. Images rarely have it, and layers are shared, so we never edit
a cached layer: we write a small per-image layer with amended ``/etc/passwd``, ``/etc/group`` (and
``/etc/shadow`` when present) plus ``/home/user`` owned 1000:1000. Directories in it copy the owner and
mode of the layer below, because an overlay upper directory's attributes win.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from aenv.images.lookup import lookup

USER = "user"
UID = GID = 1000
HOME = "/home/user"
_DEFAULT_PASSWD = "root:x:0:0:root:/root:/bin/sh\n"
_DEFAULT_GROUP = "root:x:0:\n"


def _has_entry(text: str, name: str) -> bool:
    return any(line.split(":", 1)[0] == name for line in text.splitlines())


def _read(lowers: Sequence[Path], rel: str) -> tuple[str | None, Path | None]:
    p = lookup(lowers, rel)
    if p is None or not p.is_file():
        return None, p
    return p.read_text(errors="surrogateescape"), p


def _add_line(text: str, line: str, id_field: int, ident: int) -> str:
    """Append ``line``, or insert it before an existing entry with the same numeric id so that
    uid→name lookups (``id``, ``ls -l``, ``whoami``) answer ``user``: the first match wins."""
    lines = text.rstrip("\n").split("\n") if text.strip() else []
    for i, existing in enumerate(lines):
        fields = existing.split(":")
        if len(fields) > id_field and fields[id_field] == str(ident):
            lines.insert(i, line)
            break
    else:
        lines.append(line)
    return "\n".join(lines) + "\n"


def needs_user_layer(lowers_top_first: Sequence[Path]) -> bool:
    passwd, _ = _read(lowers_top_first, "etc/passwd")
    home = lookup(lowers_top_first, HOME)
    return passwd is None or not _has_entry(passwd, USER) or home is None


def _mkdir_like(dst: Path, src: Path | None, default_mode: int = 0o755) -> None:
    dst.mkdir(exist_ok=True)
    if src is not None and src.is_dir():
        st = os.stat(src)
        os.chmod(dst, st.st_mode & 0o7777)
        if os.geteuid() == 0:
            os.chown(dst, st.st_uid, st.st_gid)
    else:
        os.chmod(dst, default_mode)


def _write_like(dst: Path, text: str, src: Path | None, default_mode: int = 0o644) -> None:
    dst.write_text(text, errors="surrogateescape")
    if src is not None:
        st = os.stat(src)
        os.chmod(dst, st.st_mode & 0o7777)
        if os.geteuid() == 0:
            os.chown(dst, st.st_uid, st.st_gid)
    else:
        os.chmod(dst, default_mode)


def login_shell(lowers_top_first: Sequence[Path]) -> str:
    for shell in ("/bin/bash", "/usr/bin/bash", "/bin/sh", "/usr/bin/sh"):
        if lookup(lowers_top_first, shell) is not None:
            return shell
    return "/bin/sh"


def write_user_layer(lowers_top_first: Sequence[Path], out: Path) -> bool:
    """Write the extra layer into ``out`` if the image lacks ``user``; returns whether it was needed."""
    if not needs_user_layer(lowers_top_first):
        return False
    out.mkdir(parents=True, exist_ok=True)
    etc = out / "etc"
    _mkdir_like(etc, lookup(lowers_top_first, "etc"))
    passwd, passwd_src = _read(lowers_top_first, "etc/passwd")
    group, group_src = _read(lowers_top_first, "etc/group")
    shadow, shadow_src = _read(lowers_top_first, "etc/shadow")
    passwd = passwd if passwd is not None else _DEFAULT_PASSWD
    group = group if group is not None else _DEFAULT_GROUP
    if not _has_entry(passwd, USER):
        passwd = _add_line(passwd, f"{USER}:x:{UID}:{GID}::{HOME}:{login_shell(lowers_top_first)}", 2, UID)
    if not _has_entry(group, USER):
        group = _add_line(group, f"{USER}:x:{GID}:", 2, GID)
    _write_like(etc / "passwd", passwd, passwd_src)
    _write_like(etc / "group", group, group_src)
    if shadow is not None and not _has_entry(shadow, USER):
        _write_like(
            etc / "shadow", shadow.rstrip("\n") + f"\n{USER}:!:19000:0:99999:7:::\n", shadow_src, 0o640
        )
    home_parent = out / "home"
    _mkdir_like(home_parent, lookup(lowers_top_first, "home"))
    existing_home = lookup(lowers_top_first, HOME)
    home = out / HOME.lstrip("/")
    if existing_home is None:
        home.mkdir(mode=0o750, exist_ok=True)
        os.chmod(home, 0o750)
        for skel in (".bashrc", ".profile"):
            src = lookup(lowers_top_first, f"etc/skel/{skel}")
            if src is not None and src.is_file():
                shutil.copyfile(src, home / skel)
                if os.geteuid() == 0:
                    os.chown(home / skel, UID, GID)
        if os.geteuid() == 0:
            os.chown(home, UID, GID)
    return True

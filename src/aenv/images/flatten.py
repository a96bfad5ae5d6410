"""Flatten a stack of overlay-format layer dirs into one plain tree (the VM runtime's ext4 source).

The ``ns`` runtime mounts the layers as overlay lowers directly; a VM needs one filesystem image, so
this merges them the way overlayfs would show them: 0/0 character devices delete, opaque directories
hide everything below them, hard links inside a layer stay hard links. Blocking and root-only (owners,
device nodes); call it in a thread. The destination is written under a temp name and renamed, so a
killed flatten never leaves a half tree under the final name.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Sequence
from pathlib import Path

from aenv.images.unpack import OVERLAY_OPAQUE_XATTR


def _opaque(path: str) -> bool:
    try:
        return os.getxattr(path, OVERLAY_OPAQUE_XATTR, follow_symlinks=False) == b"y"
    except OSError:
        return False


def _remove(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _copy_meta(src: str, dst: str, st: os.stat_result) -> None:
    if os.geteuid() == 0:
        os.lchown(dst, st.st_uid, st.st_gid)
    try:
        for name in os.listxattr(src, follow_symlinks=False):
            if name.startswith("trusted.overlay."):
                continue
            os.setxattr(dst, name, os.getxattr(src, name, follow_symlinks=False), follow_symlinks=False)
    except OSError:
        pass
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(dst, stat.S_IMODE(st.st_mode))
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _apply_layer(layer: Path, dest: Path, dirs: dict[str, tuple[str, os.stat_result]]) -> None:
    links: dict[tuple[int, int], str] = {}
    for dirpath, dirnames, filenames in os.walk(layer):
        rel = os.path.relpath(dirpath, layer)
        ddir = os.path.normpath(os.path.join(dest, rel))
        if rel != "." and _opaque(dirpath):
            for child in os.listdir(ddir):
                _remove(os.path.join(ddir, child))
        for name in [*dirnames, *filenames]:
            src = os.path.join(dirpath, name)
            dst = os.path.join(ddir, name)
            st = os.lstat(src)
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                _remove(dst)
                continue
            if stat.S_ISDIR(st.st_mode):
                if not os.path.isdir(dst) or os.path.islink(dst):
                    _remove(dst)
                    os.mkdir(dst, 0o700)
                dirs[dst] = (src, st)
                continue
            _remove(dst)
            key = (st.st_dev, st.st_ino)
            if st.st_nlink > 1 and key in links:
                os.link(links[key], dst)
                continue
            if stat.S_ISREG(st.st_mode):
                shutil.copyfile(src, dst, follow_symlinks=False)
            elif stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(src), dst)
            elif stat.S_ISFIFO(st.st_mode):
                os.mkfifo(dst)
            else:
                os.mknod(dst, st.st_mode, st.st_rdev)
            _copy_meta(src, dst, st)
            if st.st_nlink > 1:
                links[key] = dst


def flatten_layers(lowers_top_first: Sequence[Path], dest: Path) -> Path:
    """Write the merged view of ``lowers_top_first`` (``PulledImage.lowers``) to ``dest``."""
    tmp = dest.parent / f".tmp-{dest.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        dirs: dict[str, tuple[str, os.stat_result]] = {}
        for layer in reversed(lowers_top_first):
            _apply_layer(layer, tmp, dirs)
        for dst, (src, st) in sorted(dirs.items(), key=lambda kv: -kv[0].count("/")):
            if os.path.isdir(dst):
                _copy_meta(src, dst, st)
        os.chmod(tmp, 0o755)
        os.rename(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest

"""Frozen guest RAM: the directory of template RAM files, a ramfs so that no child can punch them.

A template's RAM file is mapped ``share=off`` by every sandbox restored from it: the sandbox's
writes go to private copy-on-write pages and every page it has not written is read from the
file. The file must therefore never change. QEMU 7.2 breaks that on its own: when a guest
gives memory back (virtio-balloon free page reporting, or inflating the balloon), QEMU's
``ram_block_discard_range`` calls ``fallocate(PUNCH_HOLE)`` on the RAM file *even when the
mapping is private* (later QEMUs warn about exactly this), and only then drops its private
pages. One sandbox that frees memory thus zeroes pages of the template under every other
sandbox of that template, and the guest decides when (seen with strace: 4 MiB punches at the
offsets the child freed).

ramfs has no ``fallocate`` at all, so the punch fails (QEMU logs it and keeps the private
pages), whatever the guest does. The price: a sandbox on a template cannot hand freed memory
back while it runs; a paused one still can (released to disk, see ``pressure.py``), and RAM
files a single VM owns (``share=on``) stay in tmpfs where giving memory back works.

The mount lives inside the state dir's RAM directory in ``/dev/shm`` and outlives the server
(so templates survive restarts, as the tmpfs files did); :func:`remove_tree` unmounts it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

RAMFS_MAGIC = 0x858458F6
_BLOCK = 64 * 1024
_ZERO = bytes(_BLOCK)
FS_OPTIONS = "mode=0700"


class FrozenRamError(RuntimeError):
    """The ramfs for frozen RAM files could not be mounted."""


def fs_magic(path: Path) -> int:
    """``statfs(path).f_type`` (the first field of ``struct statfs`` on Linux)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on x86_64
    if libc.statfs(os.fsencode(str(path)), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))
    return int.from_bytes(buf.raw[:8], "little", signed=False) & 0xFFFFFFFF


def is_frozen_store(path: Path) -> bool:
    """True when ``path`` (a directory or a file in it) is on a ramfs."""
    try:
        return fs_magic(path) == RAMFS_MAGIC
    except OSError:
        return False


def _mount_points_under(root: Path) -> list[Path]:
    """Mount points at or below ``root``, deepest first (``/proc/self/mounts`` escapes spaces)."""
    real = os.path.realpath(root)
    points = []
    with open("/proc/self/mounts", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 2:
                continue
            mp = fields[1].encode().decode("unicode_escape")
            if mp == real or mp.startswith(real.rstrip("/") + "/"):
                points.append(Path(mp))
    return sorted(set(points), key=lambda p: len(str(p)), reverse=True)


def _empty(directory: Path) -> None:
    """Remove everything inside ``directory`` (not the directory itself)."""
    for child in directory.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def ensure(path: Path) -> None:
    """Make ``path`` a ramfs mount (idempotent). Files already in a plain directory there (RAM
    files from before this store existed) are deleted first: they are not protected, and
    templates whose RAM file is gone are rebuilt."""
    if is_frozen_store(path):
        return
    path.mkdir(parents=True, exist_ok=True)
    _empty(path)
    proc = subprocess.run(
        ["mount", "-t", "ramfs", "-o", FS_OPTIONS, "aenv-frozen-ram", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0 or not is_frozen_store(path):
        raise FrozenRamError(
            f"cannot mount a ramfs on {path}: {proc.stderr.strip() or 'not a ramfs after mount'}"
        )
    log.info("vm: frozen RAM store mounted (ramfs) on %s", path)


def remove_tree(root: Path) -> None:
    """Delete ``root`` and everything in it, unmounting any mount below it first. A mount still
    in use (a QEMU maps a file there) is detached lazily and freed when its last user ends."""
    if not root.exists():
        return
    for mp in _mount_points_under(root):
        # Delete the files first: a lazily detached ramfs keeps its pages until the last user goes.
        if mp.is_dir():
            _empty(mp)
        proc = subprocess.run(["umount", str(mp)], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            subprocess.run(["umount", "-l", str(mp)], capture_output=True, check=False)
    shutil.rmtree(root, ignore_errors=True)


def copy_sparse(src: Path, dst: Path) -> int:
    """Copy ``src`` to ``dst`` (atomically) writing only its non-zero data (guest RAM files are
    mostly holes or zero pages); returns the bytes written. Used both ways: a template's frozen RAM to its disk
    image (so snapshots layered on it survive a reboot) and an image back into the store."""
    tmp = dst.with_name(f".{dst.name}.tmp")
    copied = 0
    with src.open("rb") as fin, tmp.open("wb") as fout:
        size = os.fstat(fin.fileno()).st_size
        fout.truncate(size)
        pos = 0
        while pos < size:
            try:
                start = os.lseek(fin.fileno(), pos, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole is left
                break
            end = os.lseek(fin.fileno(), start, os.SEEK_HOLE)
            while start < end:  # copy_file_range refuses tmpfs <-> disk: plain reads and writes
                chunk = os.pread(fin.fileno(), min(end - start, 8 * 2**20), start)
                if not chunk:
                    raise OSError(f"{src}: unexpected end at {start}")
                # ramfs reports no holes at all, and guest RAM is mostly zero pages: zero blocks
                # stay holes in the copy (it was truncated to size, so they read as zeros).
                view = memoryview(chunk)
                for off in range(0, len(chunk), _BLOCK):
                    block = view[off : off + _BLOCK]
                    if block != _ZERO[: len(block)]:
                        os.pwrite(fout.fileno(), block, start + off)
                        copied += len(block)
                start += len(chunk)
            pos = end
    os.rename(tmp, dst)
    return copied


def link_or_copy(src: Path, dst: Path) -> None:
    """A hard link (same filesystem: no copy, the repository stores it once anyway), else a sparse
    copy: how RAM images and layers are put into snapshot and run dirs."""
    if dst.exists() and os.path.samefile(src, dst):
        return  # e.g. a resumed VM's base image, released again
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        copy_sparse(src, dst)

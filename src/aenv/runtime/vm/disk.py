"""Guest disks: ext4 images made from host directories, qcow2 bases and per-sandbox overlays.

A template's rootfs directory becomes an ext4 file system with ``mkfs.ext4 -d`` (no loop mounts,
no root needed beyond reading the files), then a compact qcow2 base. Each sandbox writes to its own
qcow2 overlay on that base. Making an overlay with ``qemu-img create`` costs ~20 ms (process start);
copying a pre-made empty overlay costs ~0.1 ms because its header only names the backing file
(notes/vmm.md §5), so :func:`clone_overlay` is the hot path.

All blocking work runs in subprocesses awaited on the loop; outputs are written to a temp name and
renamed, so a crash never leaves a half-made image under the final name.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


class DiskError(RuntimeError):
    """A disk tool failed; the message has the command and its stderr."""


async def _run(argv: list[str]) -> str:
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
    except FileNotFoundError as exc:
        hint = "apt-get install qemu-utils" if argv[0].startswith("qemu") else "apt-get install e2fsprogs"
        raise DiskError(f"{argv[0]} not found; hint: {hint}") from exc
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise DiskError(
            f"{' '.join(argv)} failed (exit {proc.returncode}): {err.decode(errors='replace')[-2000:]}"
        )
    return out.decode(errors="replace")


def tree_size(root: Path) -> int:
    """Bytes of regular files under ``root`` (without following symlinks)."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, f))
                total += st.st_blocks * 512 if st.st_blocks else st.st_size
    return total


def auto_size_mb(root: Path, slack: float = 1.25, extra_mb: int = 32) -> int:
    """A size that fits ``root`` plus ext4 metadata and some slack."""
    return int(tree_size(root) * slack / 2**20) + extra_mb


def _tmp_beside(out: Path, mode: int = 0o644) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    os.fchmod(fd, mode)  # mkstemp makes 0600; images are read by QEMU, maybe as another user
    os.close(fd)
    return Path(tmp)


@contextlib.contextmanager
def _replacing(out: Path) -> Iterator[Path]:
    """A temp path beside ``out``: renamed over ``out`` when the block succeeds, removed when it fails,
    so a half-written image is never visible under its final name."""
    tmp = _tmp_beside(out)
    try:
        yield tmp
        os.rename(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


async def make_ext4(src: Path, out: Path, size_mb: int | None = None, label: str = "aenv") -> Path:
    """A raw, sparse ext4 image of directory ``src`` (owners, modes and xattrs copied by mke2fs)."""
    size = size_mb or auto_size_mb(src)
    with _replacing(out) as tmp:
        os.truncate(tmp, size * 2**20)
        # No journal-less tricks: the root disk is written by the guest and must survive a crash.
        await _run(["mkfs.ext4", "-q", "-F", "-L", label, "-E", "root_owner=0:0", "-d", str(src), str(tmp)])
    return out


async def to_qcow2(raw: Path, out: Path) -> Path:
    """Convert a raw image to a compact qcow2 (only allocated clusters are stored)."""
    with _replacing(out) as tmp:
        await _run(["qemu-img", "convert", "-q", "-f", "raw", "-O", "qcow2", str(raw), str(tmp)])
    return out


async def create_overlay(backing: Path, out: Path, backing_format: str = "qcow2") -> Path:
    """A new empty qcow2 overlay on ``backing`` (absolute path recorded in the header)."""
    with _replacing(out) as tmp:
        await _run(
            [
                "qemu-img",
                "create",
                "-q",
                "-f",
                "qcow2",
                "-b",
                str(backing.absolute()),
                "-F",
                backing_format,
                str(tmp),
            ]
        )
    return out


async def flatten_onto(chain_top: Path, base: Path, out: Path) -> Path:
    """Write the overlay chain ending in ``chain_top`` as one qcow2 whose backing file is ``base``
    (an image further down the same chain), holding everything that differs from ``base``: the
    clusters of *every* layer between them, not only the top one's.

    A copy of the top image, rebased onto ``base`` in safe mode: ``qemu-img rebase`` writes into
    the copy each cluster it lacks whose content in the old chain differs from ``base``, and
    reads only clusters allocated above ``base``. (``qemu-img convert -B base`` would take the
    top image's own clusters alone: it assumes ``base`` is the top's direct backing file, and
    dropped the data of every lower layer.) Reads with ``-U``: a live QEMU may hold the chain,
    whose images below the top are frozen."""
    with _replacing(out) as tmp:
        await asyncio.to_thread(shutil.copyfile, chain_top, tmp)
        await _run(
            ["qemu-img", "rebase", "-q", "-U", "-f", "qcow2", "-b", str(base.absolute()), "-F", "qcow2", str(tmp)]
        )
    return out


def clone_overlay(empty_overlay: Path, out: Path) -> Path:
    """Copy a pre-made empty overlay (same backing file) to ``out``: the ~0.1 ms path."""
    with _replacing(out) as tmp:
        shutil.copyfile(empty_overlay, tmp)
    return out


QCOW2_MAGIC = b"QFI\xfb"
_MAX_BACKING_NAME = 1023  # QEMU's limit for a qcow2 backing file name


def overlay_with_backing(empty_overlay: Path, backing: Path, out: Path) -> Path:
    """A copy of a pre-made empty qcow2 overlay whose header names ``backing`` instead: a new
    overlay for a snapshot's disk checkpoint in ~0.1 ms, made before the guest stops, where
    ``blockdev-snapshot-sync`` would create one (10-50 ms) while it is stopped. Virtual size and
    backing format (qcow2) stay the pre-made overlay's, which is why the template's own empty
    overlay is the model: every image in a sandbox's chain has its size and format."""
    raw = _renamed_backing(empty_overlay.read_bytes(), backing, empty_overlay)
    with _replacing(out) as tmp:
        tmp.write_bytes(raw)
    return out


def retarget_overlay(overlay: Path, backing: Path) -> None:
    """Rename the backing file in the header of ``overlay``, an *empty* overlay, in place (same
    inode): for a QEMU that opened it while waiting for a migration and was then pointed at
    ``backing`` with ``blockdev-reopen`` (it re-reads the header when the migration completes)."""
    with overlay.open("r+b") as f:
        head = f.read(1 << 16)
        f.seek(0)
        f.write(_renamed_backing(head, backing, overlay))


def _renamed_backing(raw_in: bytes, backing: Path, what: Path) -> bytearray:
    """``raw_in`` (the start of a qcow2 image, cluster 0 at least) with its backing file name
    replaced by the absolute path of ``backing``."""
    raw = bytearray(raw_in)
    name = str(backing.absolute()).encode()
    if raw[:4] != QCOW2_MAGIC or len(raw) < 104:
        raise DiskError(f"{what}: not a qcow2 image")
    name_offset = int.from_bytes(raw[8:16], "big")
    old_size = int.from_bytes(raw[16:20], "big")
    cluster = 1 << int.from_bytes(raw[20:24], "big")
    limit = min(cluster, len(raw))
    if not name_offset or len(name) > _MAX_BACKING_NAME or name_offset + max(len(name), old_size) > limit:
        raise DiskError(f"{what}: cannot name backing file {backing} in its header")
    raw[name_offset : name_offset + old_size] = bytes(old_size)  # the old name (inside cluster 0)
    raw[name_offset : name_offset + len(name)] = name
    raw[16:20] = len(name).to_bytes(4, "big")
    return raw


async def image_info(path: Path) -> str:
    """``qemu-img info`` text, for diagnostics."""
    return await _run(["qemu-img", "info", "-U", str(path)])

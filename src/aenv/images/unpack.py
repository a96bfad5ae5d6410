"""Apply one layer tar (gzip, zstd or plain) to a directory, safely.

Two modes, because the two runtimes consume layers differently:

* ``overlay``: the layer becomes its own directory usable as an overlayfs lower. OCI whiteouts are
  translated to overlayfs's own: ``.wh.NAME`` → a 0/0 character device ``NAME``; ``.wh..wh..opq`` → the
  ``trusted.overlay.opaque=y`` xattr on the directory. Layers stay shared across images, stored once.
* ``apply``: the layer is merged onto an existing tree (a flattened rootfs, e.g. for the VM's ext4 base):
  whiteouts delete what lower layers put there; same-layer entries are kept, as the OCI spec says.

Safety: every member path is normalised and refused (``UnsafeLayer``) if it is absolute, contains ``..``
or would be written through a symlink that already exists in the destination; hard-link targets obey
the same rules. Nothing is ever opened following a symlink. Device nodes and ownership need root; as
non-root, devices are skipped and files keep the caller's uid (good enough for unit tests).
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import logging
import os
import shutil
import stat
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

from aenv.images.errors import DigestMismatch, UnsafeLayer

log = logging.getLogger(__name__)

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
OVERLAY_OPAQUE_XATTR = "trusted.overlay.opaque"
Mode = Literal["overlay", "apply"]


@dataclass(frozen=True)
class UnpackStats:
    entries: int
    bytes: int  # uncompressed tar bytes (what the layer costs on disk, roughly)
    diff_id: str  # sha256 of the uncompressed tar


class _HashingReader:
    """File-like wrapper hashing everything read through it (the diff_id of the layer)."""

    def __init__(self, raw: IO[bytes], on_bytes: Callable[[int], None] | None) -> None:
        self.raw = raw
        self.h = hashlib.sha256()
        self.n = 0
        self.on_bytes = on_bytes

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.h.update(data)
        self.n += len(data)
        if self.on_bytes and data:
            self.on_bytes(self.n)
        return data

    def drain(self) -> None:
        while self.read(1 << 20):
            pass


def open_decompressed(path: Path) -> IO[bytes]:
    """Open a layer blob, choosing the decompressor from magic bytes (media types lie sometimes)."""
    fh = open(path, "rb")
    magic = fh.read(4)
    fh.seek(0)
    if magic[:2] == b"\x1f\x8b":
        fh.close()
        return gzip.open(path, "rb")  # type: ignore[return-value]  # owns (and closes) its file
    if magic == b"\x28\xb5\x2f\xfd":
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(fh, read_across_frames=True, closefd=True)
    return fh


def _clean_name(name: str, reference: str) -> str:
    """Archive member name → safe relative path ('' for the root itself)."""
    original = name
    while name.startswith("./"):
        name = name[2:]
    name = name.rstrip("/")
    if name in ("", "."):
        return ""
    if name.startswith("/"):
        raise UnsafeLayer(reference, original, "is an absolute path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise UnsafeLayer(reference, original, "escapes the root with '..'")
    return "/".join(parts)


class _Applier:
    def __init__(self, dest: Path, mode: Mode, reference: str) -> None:
        self.dest = dest
        self.mode = mode
        self.reference = reference
        self.is_root = os.geteuid() == 0
        self.seen: set[str] = set()  # paths written by this layer (whiteouts don't touch them)
        self.dir_meta: list[tuple[str, tarfile.TarInfo]] = []
        self.opaque: list[str] = []

    # -- path safety ---------------------------------------------------------------------------------

    def _parent_ok(self, rel: str, member: str) -> str:
        """Make sure every parent of ``rel`` is a real directory in dest (creating missing ones)."""
        cur = str(self.dest)
        parts = rel.split("/")[:-1]
        for i, part in enumerate(parts):
            cur = os.path.join(cur, part)
            try:
                st = os.lstat(cur)
            except FileNotFoundError:
                os.mkdir(cur, 0o755)
                continue
            if stat.S_ISLNK(st.st_mode):
                raise UnsafeLayer(
                    self.reference, member, f"goes through symlink '{'/'.join(parts[: i + 1])}'"
                )
            if not stat.S_ISDIR(st.st_mode):
                if self.mode == "apply" or self._is_whiteout_dev(st):
                    os.unlink(cur)
                    os.mkdir(cur, 0o755)
                else:
                    raise UnsafeLayer(self.reference, member, f"has non-directory parent '{part}'")
        return os.path.join(str(self.dest), rel)

    @staticmethod
    def _is_whiteout_dev(st: os.stat_result) -> bool:
        return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0

    def _clear(self, path: str, keep_dir: bool = False) -> None:
        """Remove whatever is at ``path`` (never following symlinks)."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            if keep_dir:
                return
            shutil.rmtree(path)
        else:
            os.unlink(path)

    # -- members -------------------------------------------------------------------------------------

    def apply(self, tf: tarfile.TarFile, ti: tarfile.TarInfo) -> None:
        rel = _clean_name(ti.name, self.reference)
        if rel == "":
            return
        base = rel.rsplit("/", 1)[-1]
        if base.startswith(WHITEOUT):
            self._whiteout(rel, base, ti.name)
            return
        path = self._parent_ok(rel, ti.name)
        self.seen.add(rel)
        if ti.isdir():
            self._clear(path, keep_dir=True)
            if not os.path.lexists(path):
                os.mkdir(path, 0o700)
            self.dir_meta.append((path, ti))
            return
        self._clear(path)
        if ti.isreg():
            src = tf.extractfile(ti)
            assert src is not None
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        elif ti.issym():
            os.symlink(ti.linkname, path)
        elif ti.islnk():
            target_rel = _clean_name(ti.linkname, self.reference)
            if not target_rel:
                raise UnsafeLayer(self.reference, ti.name, "hard-links to the root directory")
            target = self._parent_ok(target_rel, ti.name)
            if not os.path.lexists(target):
                raise UnsafeLayer(self.reference, ti.name, f"hard-links to missing '{ti.linkname}'")
            os.link(target, path, follow_symlinks=False)
            return  # a hard link shares the target's inode: metadata is the target's
        elif ti.ischr() or ti.isblk():
            if not self.is_root:
                log.debug("skipping device %s (not root)", rel)
                self.seen.discard(rel)
                return
            kind = stat.S_IFCHR if ti.ischr() else stat.S_IFBLK
            os.mknod(path, kind | (ti.mode & 0o7777), os.makedev(ti.devmajor, ti.devminor))
        elif ti.isfifo():
            os.mkfifo(path, ti.mode & 0o7777)
        else:
            log.debug("skipping unsupported member type %r: %s", ti.type, rel)
            return
        self._meta(path, ti)

    def _whiteout(self, rel: str, base: str, member: str) -> None:
        parent_rel = rel.rsplit("/", 1)[0] if "/" in rel else ""
        parent = os.path.dirname(self._parent_ok(rel, member))  # parents exist and are no symlinks
        if base == OPAQUE:
            self.opaque.append(parent_rel)
            return
        name = base[len(WHITEOUT) :]
        if not name or name in (".", "..") or "/" in name:
            raise UnsafeLayer(self.reference, member, "is a malformed whiteout")
        target_rel = f"{parent_rel}/{name}" if parent_rel else name
        target = os.path.join(parent, name)
        if self.mode == "overlay":
            self._clear(target)
            if self.is_root:
                os.mknod(target, stat.S_IFCHR | 0o000, os.makedev(0, 0))
            else:  # unit tests as non-root: keep the OCI marker so the information is not lost
                open(os.path.join(parent, base), "wb").close()
        elif target_rel not in self.seen:
            self._clear(target)

    def _meta(self, path: str, ti: tarfile.TarInfo) -> None:
        if self.is_root:
            os.lchown(path, ti.uid, ti.gid)
        for key, value in (ti.pax_headers or {}).items():
            if key.startswith("SCHILY.xattr."):
                name = key[len("SCHILY.xattr.") :]
                raw = value.encode("utf-8", "surrogateescape") if isinstance(value, str) else value
                try:
                    os.setxattr(path, name, raw, follow_symlinks=False)
                except OSError as exc:
                    if exc.errno not in (errno.ENOTSUP, errno.EPERM, errno.EOPNOTSUPP):
                        raise
                    log.debug("xattr %s on %s not kept: %s", name, path, exc)
        if not ti.issym():
            os.chmod(path, ti.mode & 0o7777)  # after chown: chown clears setuid bits
        try:
            os.utime(path, (ti.mtime, ti.mtime), follow_symlinks=False)
        except OSError:
            pass

    def finish(self) -> None:
        for parent_rel in self.opaque:
            parent = os.path.join(str(self.dest), parent_rel) if parent_rel else str(self.dest)
            if self.mode == "overlay":
                if self.is_root:
                    os.setxattr(parent, OVERLAY_OPAQUE_XATTR, b"y")
                else:
                    open(os.path.join(parent, OPAQUE), "wb").close()
            else:
                prefix = f"{parent_rel}/" if parent_rel else ""
                for entry in os.listdir(parent):
                    if f"{prefix}{entry}" not in self.seen:
                        self._clear(os.path.join(parent, entry))
        # directories last, deepest first, so creating children does not undo their mtime/mode
        for path, ti in reversed(self.dir_meta):
            self._meta(path, ti)


def unpack_layer(
    blob: Path,
    dest: Path,
    *,
    mode: Mode = "overlay",
    reference: str = "",
    expected_diff_id: str | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> UnpackStats:
    """Apply ``blob`` onto ``dest`` (created if missing). Blocking: run it in a thread.

    ``expected_diff_id`` (from the image config) is checked after the whole tar was read; the caller
    discards ``dest`` on ``DigestMismatch``.
    """
    dest.mkdir(parents=True, exist_ok=True)
    applier = _Applier(dest, mode, reference)
    entries = 0
    with open_decompressed(blob) as raw:
        reader = _HashingReader(raw, on_bytes)
        with tarfile.open(fileobj=reader, mode="r|", errorlevel=1) as tf:  # type: ignore[call-overload]
            for ti in tf:
                applier.apply(tf, ti)
                entries += 1
        reader.drain()
    applier.finish()
    diff_id = "sha256:" + reader.h.hexdigest()
    if expected_diff_id and expected_diff_id != diff_id:
        raise DigestMismatch(reference, expected_diff_id, diff_id)
    return UnpackStats(entries, reader.n, diff_id)

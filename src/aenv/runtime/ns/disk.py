"""Per-sandbox disk quota for the ns runtime: one btrfs volume, a subvolume + qgroup limit per sandbox.

An ns sandbox writes into its overlay upper dir, so its disk size (``SandboxSpec.disk_mb``) can only
be enforced by the filesystem holding that dir. The classic way (Docker's overlay2 on xfs) is a
project quota. Here that is not possible: this kernel has neither ``CONFIG_QFMT_V2`` (ext4 quota
files) nor ``CONFIG_XFS_QUOTA``. btrfs qgroups need no option of their own and btrfs is in every
distribution kernel, so the ns runtime keeps its sandbox directories on a btrfs volume::

    <state>/ns-volume.btrfs     sparse image, made once (size: ns_volume_mb, default
                                min(64 GiB, half the free space)); ``mkfs.btrfs`` from btrfs-progs
    <state>/sandboxes/          its mount point (loop, noatime, discard=async: freed blocks are
                                punched out of the image, so the host gets its space back)
        .ns-pool/pool-…/        a pooled sandbox's root         - one subvolume each
        <id>/ns/                a handed-out sandbox's root     - the same subvolume, renamed
        <id>/.rollback-…/       rollback's old and new roots    - subvolumes too

Each sandbox root (upper, work, run, mount point) is a subvolume with a qgroup limit on its
referenced bytes (``max_rfer`` = disk size). Writes past it fail inside the sandbox with EDQUOT
("Disk quota exceeded"); other sandboxes and the server are unaffected. Simple quotas (kernel
>= 6.7) are used where the kernel has them - accounting at extent allocation, no back-reference
walks, and a deleted subvolume's qgroup disappears once the cleaner dropped it - else classic
qgroups. A state dir that already is a btrfs filesystem with quotas on is used as is (no image).

Rules that follow from subvolumes:

* a subvolume root can be renamed anywhere on the volume (pool hand-out, rollback swap), but a
  file or directory cannot cross a subvolume boundary (EXDEV): the runtime only ever moves whole
  sandbox roots;
* a subvolume is deleted in constant time (``BTRFS_IOC_SNAP_DESTROY``; the cleaner frees the
  extents in the background): ``remove_tree`` does that before falling back to ``rmtree``;
* the qgroup limit is set when the root is made, at pool fill for pooled sandboxes; hand-out only
  changes it if the sandbox asks for another size (one ioctl).

Lifecycle: ``DiskQuota.setup`` (ns start) mounts the image, re-using a loop device already attached
to it (a volume whose host mount went away while sandboxes in their own mount namespaces still use
it must never be attached twice); ``release`` (ns close) unmounts it unless another runtime on the
same state dir has it open (a shared ``flock``). Sandboxes that outlive the server keep the
filesystem (and its loop device, auto-cleared once the last user is gone) alive in their own mount
namespaces, and the next start mounts that same device again. After a crash the volume simply stays
mounted and the next start adopts it. If anything is missing (no root, no btrfs, no loop devices,
no ``mkfs.btrfs``, a pre-existing non-empty sandboxes dir), the runtime runs without quotas, warns
once and says why in ``capabilities()`` and ``aenv doctor``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import stat
import struct
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("aenv.runtime.ns")

IMAGE_NAME = "ns-volume.btrfs"
LOCK_NAME = "ns-volume.lock"
POOL_NAME = ".ns-pool"  # the warm pool's directory, inside the sandboxes dir (same volume)
MAX_AUTO_BYTES = 64 << 30
MIN_BYTES = 1 << 30
MOUNT_OPTIONS = "noatime,discard=async"
MKFS = ["mkfs.btrfs", "-q", "-f", "--nodiscard", "-L", "aenv-ns", "-m", "single", "-d", "single"]

# ---- btrfs ioctls (linux/btrfs.h) ---------------------------------------------------------------
SUBVOL_ROOT_INO = 256  # BTRFS_FIRST_FREE_OBJECTID: every subvolume's root directory has this inode
TOP_LEVEL_ID = 5  # BTRFS_FS_TREE_OBJECTID: the filesystem's own top-level subvolume
UNLIMITED = (1 << 64) - 1  # CLEAR_VALUE: drops a qgroup limit


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (0x94 << 8) | nr


_W, _R = 1, 2
SUBVOL_CREATE = _ioc(_W, 14, 4096)  # struct btrfs_ioctl_vol_args
SNAP_DESTROY = _ioc(_W, 15, 4096)  # struct btrfs_ioctl_vol_args
INO_LOOKUP = _ioc(_W | _R, 18, 4096)  # struct btrfs_ioctl_ino_lookup_args
FS_INFO = _ioc(_R, 31, 1024)  # struct btrfs_ioctl_fs_info_args
QUOTA_CTL = _ioc(_W | _R, 40, 16)  # struct btrfs_ioctl_quota_ctl_args
QGROUP_LIMIT = _ioc(_R, 43, 48)  # struct btrfs_ioctl_qgroup_limit_args
QUOTA_ENABLE, QUOTA_ENABLE_SIMPLE = 1, 4
QGROUP_LIMIT_MAX_RFER = 1
VOL_NAME_MAX = 4087


def vol_args(name: str) -> bytearray:
    """``struct btrfs_ioctl_vol_args {s64 fd; char name[4088];}`` for a name in the fd's directory."""
    raw = os.fsencode(name)
    if not raw or b"/" in raw or len(raw) > VOL_NAME_MAX or raw in (b".", b".."):
        raise ValueError(f"bad subvolume name {name!r}")
    return bytearray(struct.pack("=q4088s", 0, raw))


def qgroup_limit_args(max_bytes: int | None) -> bytearray:
    """``struct btrfs_ioctl_qgroup_limit_args`` limiting the referenced bytes of the fd's own
    subvolume (qgroupid 0); ``None`` removes the limit."""
    value = UNLIMITED if max_bytes is None else int(max_bytes)
    if not 0 < value <= UNLIMITED:
        raise ValueError(f"bad limit {max_bytes!r}")
    return bytearray(struct.pack("=QQQQQQ", 0, QGROUP_LIMIT_MAX_RFER, value, 0, 0, 0))


def ino_lookup_args() -> bytearray:
    """``struct btrfs_ioctl_ino_lookup_args`` asking for the tree (subvolume) id of the fd."""
    return bytearray(struct.pack("=QQ4080s", 0, SUBVOL_ROOT_INO, b""))


def parse_ino_lookup(buf: bytes | bytearray) -> int:
    return int(struct.unpack_from("=Q", buf)[0])


def parse_fs_info(buf: bytes | bytearray) -> str:
    """The filesystem UUID (``/sys/fs/btrfs/<uuid>``) from ``struct btrfs_ioctl_fs_info_args``."""
    return str(uuid.UUID(bytes=bytes(buf[16:32])))


@contextlib.contextmanager
def _dir_fd(path: Path) -> Iterator[int]:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        yield fd
    finally:
        os.close(fd)


def create_subvolume(path: Path) -> None:
    """Make ``path`` (which must not exist; its parent must) a new, empty subvolume."""
    with _dir_fd(path.parent) as fd:
        fcntl.ioctl(fd, SUBVOL_CREATE, vol_args(path.name))


def destroy_subvolume(path: Path) -> bool:
    """Delete the subvolume rooted at ``path`` with everything in it. False if it is not one (or
    the kernel refused); the caller then removes it file by file."""
    try:
        with _dir_fd(path.parent) as fd:
            fcntl.ioctl(fd, SNAP_DESTROY, vol_args(path.name))
        return True
    except (OSError, ValueError):
        return False


def subvolume_id(path: Path) -> int | None:
    """The subvolume id if ``path`` is the root of a (non top-level) btrfs subvolume, else None."""
    try:
        if os.lstat(path).st_ino != SUBVOL_ROOT_INO:
            return None
        buf = ino_lookup_args()
        with _dir_fd(path) as fd:
            fcntl.ioctl(fd, INO_LOOKUP, buf)
    except OSError:
        return None
    sid = parse_ino_lookup(buf)
    return sid if sid > TOP_LEVEL_ID else None


def set_limit(path: Path, max_bytes: int | None) -> None:
    with _dir_fd(path) as fd:
        fcntl.ioctl(fd, QGROUP_LIMIT, qgroup_limit_args(max_bytes))


def fs_uuid(path: Path) -> str | None:
    """The btrfs filesystem UUID of ``path``, or None if it is not on btrfs."""
    buf = bytearray(1024)
    try:
        with _dir_fd(path) as fd:
            fcntl.ioctl(fd, FS_INFO, buf)
    except OSError:
        return None
    return parse_fs_info(buf)


def quota_mode(fs: str) -> str | None:
    """"simple" / "qgroup" if quotas are on for filesystem ``fs`` (a UUID), else None."""
    q = Path("/sys/fs/btrfs") / fs / "qgroups"
    if not q.is_dir():
        return None
    try:
        mode = (q / "mode").read_text().strip()
    except OSError:
        mode = "qgroup"  # kernels before simple quotas have no mode file
    return "simple" if mode == "squota" else "qgroup"


def enable_quota(mount: Path) -> str:
    """Turn quotas on, simple quotas where the kernel has them. Returns the mode."""
    with _dir_fd(mount) as fd:
        try:
            fcntl.ioctl(fd, QUOTA_CTL, bytearray(struct.pack("=QQ", QUOTA_ENABLE_SIMPLE, 0)))
            return "simple"
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTTY):
                raise
            fcntl.ioctl(fd, QUOTA_CTL, bytearray(struct.pack("=QQ", QUOTA_ENABLE, 0)))
            return "qgroup"


def qgroup_referenced(fs: str, subvol: int) -> int | None:
    try:
        return int((Path("/sys/fs/btrfs") / fs / "qgroups" / f"0_{subvol}" / "referenced").read_text())
    except (OSError, ValueError):
        return None


def remove_tree(path: Path) -> None:
    """``rmtree`` that first drops subvolumes (``path`` itself, or its direct children) in
    constant time. Never raises; a missing ``path`` is fine."""
    try:
        st = os.lstat(path)
    except OSError:
        return
    if stat.S_ISDIR(st.st_mode):
        if st.st_ino == SUBVOL_ROOT_INO and destroy_subvolume(path):
            return
        with contextlib.suppress(OSError), os.scandir(path) as it:
            for e in list(it):
                with contextlib.suppress(OSError):
                    if e.is_dir(follow_symlinks=False) and e.stat(follow_symlinks=False).st_ino == SUBVOL_ROOT_INO:
                        destroy_subvolume(Path(e.path))
    shutil.rmtree(path, ignore_errors=True)


# ---- mounts and loop devices -------------------------------------------------------------------
@dataclass(frozen=True)
class MountEntry:
    mount_point: str
    fstype: str
    source: str


def _unescape(field: str) -> str:
    """Undo mountinfo's octal escapes (``\\040`` for a space)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[MountEntry]:
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 2:
            out.append(MountEntry(_unescape(fields[4]), tail[0], _unescape(tail[1])))
    return out


def mount_at(path: Path) -> MountEntry | None:
    """The (top-most) mount whose mount point is exactly ``path``."""
    want = str(path.resolve())
    found = None
    with contextlib.suppress(OSError):
        for m in parse_mountinfo(Path("/proc/self/mountinfo").read_text()):
            if m.mount_point == want:
                found = m
    return found


def loop_device_for(image: Path) -> str | None:
    """The loop device already attached to ``image``, if any."""
    target = str(image.resolve())
    for bf in sorted(Path("/sys/block").glob("loop*/loop/backing_file")):
        with contextlib.suppress(OSError):
            if bf.read_text().strip() == target:
                return f"/dev/{bf.parent.parent.name}"
    return None


def _run(argv: list[str], timeout: float = 120.0) -> None:
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
                          check=False)
    if proc.returncode != 0:
        raise OSError(errno.EIO, f"{' '.join(argv)}: {(proc.stderr or proc.stdout).strip()[-300:]}")


def _fmt_size(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n >> 20} MiB"


def auto_size(free_bytes: int) -> int:
    """Default image size: min(64 GiB, half the free space), in whole MiB."""
    return (min(MAX_AUTO_BYTES, free_bytes // 2) >> 20) << 20


class Unavailable(Exception):
    pass


def _prerequisites() -> None:
    if os.geteuid() != 0:
        raise Unavailable("needs root")
    try:
        builtin = "btrfs" in Path("/proc/filesystems").read_text()
    except OSError:
        builtin = False
    if not builtin and not (Path("/lib/modules") / os.uname().release / "kernel/fs/btrfs").is_dir():
        raise Unavailable("the kernel has no btrfs")  # (a module is loaded by the first mount)


def _loop_prerequisites(need_mkfs: bool) -> None:
    if not Path("/dev/loop-control").exists():
        raise Unavailable("no loop devices (/dev/loop-control is missing)")
    if need_mkfs and shutil.which("mkfs.btrfs") is None:
        raise Unavailable("mkfs.btrfs not found (apt-get install btrfs-progs)")


class DiskQuota:
    """The ns runtime's sandbox volume and the per-sandbox limits on it (see the module doc).

    Blocking methods: call them in a thread."""

    def __init__(self, state_dir: Path, mount: Path, *, enabled: bool = True, size_mb: int = 0) -> None:
        self.state_dir = state_dir
        self.mount = mount  # the sandboxes dir
        self.image = state_dir / IMAGE_NAME
        self.enabled = enabled
        self.size_mb = size_mb
        self.active = False
        self.owned = False  # the volume is our loop-mounted image (so we may unmount it)
        self.reason = "not set up yet"
        self.mode = ""
        self.fs: str | None = None
        self._lock: int | None = None
        self._warned = False

    # -- set-up and tear-down --
    def setup(self) -> None:
        """Make the volume ready (idempotent). Never raises: without it sandboxes run unlimited."""
        if self.active:
            return
        try:
            self._setup()
        except (Unavailable, OSError, subprocess.SubprocessError) as exc:
            self.active = False
            self.reason = str(exc)
            if not self._warned:
                self._warned = True
                log.warning("ns disk quota unavailable: %s; sandboxes' disk size is not enforced", self.reason)
            return
        self.active = True
        log.info("ns disk quota: %s", self.mode)

    def _setup(self) -> None:
        if not self.enabled:
            raise Unavailable("disabled (ns_disk_quota = false)")
        _prerequisites()
        self.mount.mkdir(parents=True, exist_ok=True)
        self._take_lock()
        entry = mount_at(self.mount)
        if entry is None:
            fs = fs_uuid(self.mount)
            if fs is not None and quota_mode(fs) is not None:  # the state dir itself is btrfs with quotas
                self.fs, self.owned = fs, False
                self.mode = f"btrfs subvolume per sandbox on {self.mount} ({quota_mode(fs)} quotas)"
                return
            self._attach()
            entry = mount_at(self.mount)
            if entry is None:
                raise Unavailable(f"mounting {self.image} on {self.mount} did not take effect")
        if entry.fstype != "btrfs":
            raise Unavailable(f"{self.mount} is a {entry.fstype} mount, not btrfs")
        self.owned = self._is_ours(entry)
        fs = fs_uuid(self.mount)
        if fs is None:
            raise Unavailable(f"{self.mount}: not a btrfs filesystem")
        mode = quota_mode(fs)
        if mode is None:
            if not self.owned:
                raise Unavailable(f"btrfs quotas are off on {self.mount} (btrfs quota enable {self.mount})")
            mode = enable_quota(self.mount)
        self.fs = fs
        where = f"loop volume {self.image} ({_fmt_size(self.image.stat().st_size)})" if self.owned \
            else f"btrfs mount {self.mount}"
        self.mode = f"btrfs subvolume per sandbox on {where}, {mode} quotas"

    def _is_ours(self, entry: MountEntry) -> bool:
        if not entry.source.startswith("/dev/loop") or not self.image.exists():
            return False
        name = Path(entry.source).name
        with contextlib.suppress(OSError):
            return Path(f"/sys/block/{name}/loop/backing_file").read_text().strip() == str(self.image.resolve())
        return False

    def _attach(self) -> None:
        """Mount the image (made first if needed) on the sandboxes dir."""
        _loop_prerequisites(need_mkfs=not self.image.exists())
        with os.scandir(self.mount) as it:
            held = [e.name for e in it]
        if held:
            raise Unavailable(f"{self.mount} already holds {len(held)} entries from before the ns volume "
                              "(they would be hidden); it is used once they are gone")
        if not self.image.exists():
            self._make_image()
        dev = loop_device_for(self.image)
        if dev is not None:  # still attached: the filesystem lives on in sandboxes' mount namespaces
            _run(["mount", "-t", "btrfs", "-o", MOUNT_OPTIONS, dev, str(self.mount)])
        else:
            _run(["mount", "-t", "btrfs", "-o", f"loop,{MOUNT_OPTIONS}", str(self.image), str(self.mount)])

    def _make_image(self) -> None:
        if self.size_mb:
            size = self.size_mb << 20
        else:
            st = os.statvfs(self.state_dir)
            size = auto_size(st.f_bavail * st.f_frsize)
        if size < MIN_BYTES:
            raise Unavailable(f"a {_fmt_size(size)} volume is too small (the state dir's free space is low)")
        tmp = self.image.with_name(self.image.name + ".tmp")
        try:
            with open(tmp, "wb") as fh:
                fh.truncate(size)  # sparse: blocks are allocated as sandboxes write
            _run([*MKFS, str(tmp)])
            os.replace(tmp, self.image)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        log.info("ns disk quota: made %s (%s, sparse)", self.image, _fmt_size(size))

    def _take_lock(self) -> None:
        if self._lock is None:
            fd = os.open(self.state_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)
            self._lock = fd

    def release(self) -> None:
        """At close (and from test teardown, on a state dir whose server is gone): unmount the volume
        if it is our image and no other runtime on this state dir holds it (their shared ``flock``).
        Sandboxes still running keep the filesystem alive in their own mount namespaces (and its
        loop device attached); the next start mounts that same device again."""
        fd = self._lock
        if fd is None:
            try:
                fd = os.open(self.state_dir / LOCK_NAME, os.O_RDWR | os.O_CLOEXEC)
            except OSError:
                return
        try:
            entry = mount_at(self.mount)
            if entry is None or not self._is_ours(entry):
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            with contextlib.suppress(OSError):
                (self.mount / POOL_NAME).rmdir()
            with os.scandir(self.mount) as it:
                left = sum(1 for e in it if not e.name.startswith("."))  # not the volumes dir
            try:
                _run(["umount", str(self.mount)])
            except OSError as exc:
                log.warning("ns disk quota: %s; detaching lazily", exc)
                _run(["umount", "-l", str(self.mount)])
            if left:
                log.info("ns disk quota: unmounted %s; %d sandboxes on it live on and the next start "
                         "re-attaches it", self.mount, left)
            self.active = False
            self.reason = "released"
        except OSError as exc:
            log.warning("ns disk quota: could not release %s: %s", self.mount, exc)
        finally:
            os.close(fd)
            self._lock = None

    # -- per sandbox --
    def make_root(self, root: Path, disk_mb: int) -> None:
        """Create a sandbox's root as a subvolume limited to ``disk_mb`` (before upper/ and work/
        are made in it). A root that already exists keeps its subvolume (limit refreshed); one
        that is a plain directory (made before quotas were on) stays unlimited."""
        if not self.active:
            return
        root.parent.mkdir(parents=True, exist_ok=True)
        try:
            create_subvolume(root)
        except FileExistsError:
            if subvolume_id(root) is None:
                return
        self.limit(root, disk_mb)

    def make_volume_dir(self, path: Path, limit_mb: int) -> None:
        """An E2B volume's directory (either runtime's ``VolumeCapable.make_volume_dir``): a subvolume
        limited to ``limit_mb`` when quotas are on (its bytes count here and stop there with EDQUOT),
        else a plain directory. An existing one keeps its contents."""
        if self.active:
            self.make_root(path, limit_mb)
        else:
            path.mkdir(exist_ok=True)

    def limit(self, root: Path, disk_mb: int) -> None:
        if self.active and disk_mb > 0:
            set_limit(root, disk_mb << 20)

    def usage(self, root: Path) -> int | None:
        """Bytes charged to a sandbox root's qgroup, or None without quotas."""
        if not self.active or self.fs is None:
            return None
        sid = subvolume_id(root)
        return qgroup_referenced(self.fs, sid) if sid is not None else None

    def describe(self) -> str:
        return self.mode if self.active else f"unavailable ({self.reason})"


# ---- aenv doctor ---------------------------------------------------------------------------------
def probe(state_dir: Path, mount: Path, enabled: bool = True, size_mb: int = 0) -> str:
    """What ``aenv doctor`` says: the live volume if there is one, else the result of a real trial
    (a tiny image: mount, quota, subvolume, limit, a write past it) in a temp dir."""
    if not enabled:
        return "unavailable (disabled: ns_disk_quota = false)"
    try:
        _prerequisites()
        entry = mount_at(mount)
        fs = fs_uuid(mount) if mount.is_dir() else None
        if fs is not None and (mode := quota_mode(fs)) is not None:
            what = f"loop volume {state_dir / IMAGE_NAME}" if entry is not None and entry.source.startswith("/dev/loop") \
                else f"btrfs {mount}"
            return f"btrfs subvolume per sandbox on {what}, {mode} quotas (active)"
        if entry is not None:
            return f"unavailable ({mount} is a {entry.fstype} mount without btrfs quotas)"
        _loop_prerequisites(need_mkfs=True)
        mode = _trial()
        image = state_dir / IMAGE_NAME
        if image.exists():
            size = f"{_fmt_size(image.stat().st_size)} image, made"
        elif size_mb:
            size = f"{_fmt_size(size_mb << 20)} sparse image, made at the first ns start"
        else:
            size = "sparse image of min(64 GiB, half the free space), made at the first ns start"
        return f"btrfs subvolume per sandbox on loop volume {image} ({size}), {mode} quotas"
    except (Unavailable, OSError, subprocess.SubprocessError) as exc:
        return f"unavailable ({exc})"


def _trial() -> str:
    with tempfile.TemporaryDirectory(prefix="aenv-quota-probe-") as tmp:
        image, mnt = Path(tmp) / "img", Path(tmp) / "mnt"
        mnt.mkdir()
        with open(image, "wb") as fh:
            fh.truncate(256 << 20)
        _run([*MKFS, str(image)])
        _run(["mount", "-t", "btrfs", "-o", f"loop,{MOUNT_OPTIONS}", str(image), str(mnt)])
        try:
            mode = enable_quota(mnt)
            sub = mnt / "s"
            create_subvolume(sub)
            set_limit(sub, 1 << 20)
            try:
                with open(sub / "f", "wb") as fh:
                    for _ in range(8):
                        fh.write(b"\0" * (1 << 20))
                        fh.flush()
                        os.fsync(fh.fileno())
            except OSError as exc:
                if exc.errno not in (errno.EDQUOT, errno.ENOSPC):
                    raise
            else:
                raise Unavailable("a btrfs qgroup limit was not enforced")
        finally:
            subprocess.run(["umount", str(mnt)], capture_output=True, check=False)
    return mode

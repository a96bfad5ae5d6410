"""The launcher's user-namespace steps: idmapped layer mounts, mounting as the sandbox's root, joining.

Stdlib only (``launch.py`` loads it from beside itself under ``python -I -S``). Why each step exists:

* **idmapped layers.** Files on disk keep their unshifted owners (the layer cache is shared with
  ``vm``, snapshots and published layers are written as they are), so the sandbox's uid 0 must see a
  file of on-disk uid 0 as its own: every overlay lower and the upper are bind clones carrying the
  sandbox's user namespace (``open_tree`` + ``mount_setattr(MOUNT_ATTR_IDMAP)``, ext4 and btrfs
  support it); overlayfs itself cannot be idmapped, its layers can.
* **mounting as the sandbox's root** (``as_sandbox_root``). Overlayfs creates upper files with the
  caller's fsuid, and the mounter's credentials are kept for copy-ups: host uid 0 has no mapping in
  the idmapped upper (``EOVERFLOW``, and the overlay falls back to read-only). So the launcher mounts
  the overlay and fills in the root with fsuid/fsgid set to the host uid of the sandbox's root,
  keeping its capabilities (setting fsuid clears the file capabilities from the effective set; they
  are raised again from the permitted set).
* **joining** (``join``). ``setns`` into the prepared user namespace, then uid/gid 0 of it: every
  namespace the launcher creates afterwards belongs to it, which is what CRIU needs to dump the
  tree, and host-made mounts become locked in the copied mount namespace.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator

CLONE_NEWUSER = 0x10000000
SYS_OPEN_TREE = 428
SYS_MOVE_MOUNT = 429
SYS_MOUNT_SETATTR = 442
OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = 0o2000000
AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOUNT_ATTR_IDMAP = 0x00100000
_LINUX_CAPABILITY_VERSION_3 = 0x20080522

_libc = ctypes.CDLL(None, use_errno=True)


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _fail(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def clone_tree(path: str | bytes, *, recursive: bool = False) -> int:
    """A detached copy of the mount at ``path`` (``open_tree(OPEN_TREE_CLONE)``), as an fd."""
    flags = OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | (AT_RECURSIVE if recursive else 0)
    fd = int(_libc.syscall(SYS_OPEN_TREE, AT_FDCWD, os.fsencode(path), flags))
    if fd < 0:
        raise _fail(f"open_tree {path!r}")
    return fd


def attach(fd: int, target: str | bytes) -> None:
    """Mount the detached tree ``fd`` at ``target`` and close the fd."""
    try:
        if _libc.syscall(SYS_MOVE_MOUNT, fd, b"", AT_FDCWD, os.fsencode(target), MOVE_MOUNT_F_EMPTY_PATH) != 0:
            raise _fail(f"move_mount {target!r}")
    finally:
        os.close(fd)


def idmapped_clone(src: str, userns_fd: int) -> int:
    """A detached copy of ``src`` with ``userns_fd``'s mapping applied, as an fd (nothing is mounted
    until ``attach``; closing the fd drops it). Fails (``EINVAL``) where ``src``'s filesystem cannot be
    idmapped: overlayfs, NFS, FUSE without the server's consent."""
    fd = clone_tree(src)
    try:
        attr = _MountAttr(MOUNT_ATTR_IDMAP, 0, 0, userns_fd)
        if _libc.syscall(SYS_MOUNT_SETATTR, fd, b"", AT_EMPTY_PATH, ctypes.byref(attr), ctypes.sizeof(attr)) != 0:
            raise _fail(f"idmap {src}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def idmapped_bind(src: str, target: str, userns_fd: int) -> None:
    """Bind ``src`` at ``target`` (a directory, made here) with ``userns_fd``'s mapping applied."""
    os.makedirs(target, exist_ok=True)
    attach(idmapped_clone(src, userns_fd), target)


def _raise_effective() -> None:
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    if _libc.capget(ctypes.byref(header), data) != 0:
        raise _fail("capget")
    for i in range(2):
        data[i].effective = data[i].permitted
    if _libc.capset(ctypes.byref(header), data) != 0:
        raise _fail("capset")


@contextlib.contextmanager
def as_sandbox_root(host_uid: int) -> Iterator[None]:
    """Create files (and mount the overlay) as the host uid/gid of the sandbox's root, capabilities kept."""
    _libc.setfsgid(host_uid)
    _libc.setfsuid(host_uid)
    try:
        _raise_effective()
        yield
    finally:
        _libc.setfsuid(0)
        _libc.setfsgid(0)


def join(userns_fd: int) -> None:
    """Enter the user namespace ``userns_fd`` as its root (uid/gid 0, no supplementary groups)."""
    if _libc.setns(userns_fd, CLONE_NEWUSER) != 0:
        raise _fail("setns user")
    os.setgroups([])
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)


def rebind_root() -> None:
    """Make the current directory (the sandbox root) a mount of this mount namespace: the copy made
    by ``unshare(CLONE_NEWNS)`` in a user namespace locks the host's mounts, and ``pivot_root`` refuses
    a locked new root. A recursive clone keeps every mount under it (and their locks)."""
    fd = clone_tree(".", recursive=True)
    dup = os.dup(fd)
    try:
        attach(fd, ".")
        os.fchdir(dup)
    finally:
        os.close(dup)

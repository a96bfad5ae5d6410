"""CRIU ``--action-script`` of every ns restore: at ``pre-resume`` (the restored tree exists, none of
its tasks runs yet) remount the sandbox's host bind mounts read-only again in its mount namespace.

CRIU restores an external bind mount (``--external mnt[KEY]:PATH``) by bind-mounting PATH, without
the read-only flag the launcher had set, so a restored sandbox's root could chmod, chown or touch the
host's own ``/dev/null`` inode, or write into the tools directory every sandbox shares. CRIU runs
this file as ``python -I ro_remount.py POINT:FLAGS ...`` (stdlib only: it runs under the host
interpreter in isolated mode); any failure fails the restore, so no sandbox resumes writable.
"""

from __future__ import annotations

import ctypes
import os
import sys

CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_REMOUNT, MS_BIND = 1, 32, 4096  # the other flags come with each point


def main(argv: list[str]) -> int:
    if os.environ.get("CRTOOLS_SCRIPT_ACTION") != "pre-resume":
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/proc/{int(os.environ['CRTOOLS_INIT_PID'])}/ns/mnt", os.O_RDONLY)
    if libc.setns(fd, CLONE_NEWNS) != 0:
        print(f"ro_remount: setns: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
        return 1
    os.close(fd)
    for arg in argv:
        point, _, extra = arg.rpartition(":")
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | int(extra)
        if not os.path.lexists(point):
            continue  # a /proc file this kernel does not have
        if libc.mount(None, point.encode(), None, flags, None) != 0:
            print(f"ro_remount: {point}: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A ``tar`` that CRIU finds first on its ``PATH`` at restore, for the common empty tmpfs.

CRIU saves each tmpfs of the tree (a sandbox's ``/dev/shm``) as ``tar --create --gzip`` and puts it
back with ``tar --extract --gzip ... --directory MOUNT``, the image file on stdin: an exec of ``tar``
and of ``gzip``, ~3 ms of every fork child's and pool refill's restore, almost always to unpack an
archive holding only the mount's root directory. This program inflates the image (at most a few
KiB, read with ``pread`` so the offset stays put), and when it is exactly that one-directory archive
sets the directory's mode, owner and mtime as ``tar`` would and exits; anything else (a file in it,
another command line, stdin not a file) execs the real ``tar`` unchanged.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import threading
from pathlib import Path

from aenv.runtime.tools import build_static

_SOURCE = r"""
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#define REAL_TAR "@REAL_TAR@"

static unsigned char in[8192], out[65536];

static int octal(const unsigned char *f, int n, unsigned long *v) {  /* a header's octal field */
    *v = 0;
    int i = 0, digits = 0;
    while (i < n && f[i] == ' ') i++;
    for (; i < n && f[i] >= '0' && f[i] <= '7'; i++, digits++) *v = *v * 8 + (f[i] - '0');
    for (; i < n; i++) if (f[i] != 0 && f[i] != ' ') return -1;
    return digits ? 0 : -1;
}

/* 1 when stdin is a gzip of one tar header for "./" (or ".") of type directory, then zeros; its
   mode, uid, gid and mtime in the pointers. */
static int only_root_dir(unsigned long *mode, unsigned long *uid, unsigned long *gid, unsigned long *mtime) {
    struct stat st;
    if (fstat(0, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size <= 0 || st.st_size > (off_t)sizeof in) return 0;
    ssize_t n = pread(0, in, (size_t)st.st_size, 0);
    if (n != st.st_size) return 0;
    z_stream z;
    memset(&z, 0, sizeof z);
    if (inflateInit2(&z, 16 + MAX_WBITS) != Z_OK) return 0;
    z.next_in = in; z.avail_in = (uInt)n; z.next_out = out; z.avail_out = sizeof out;
    int rc = inflate(&z, Z_FINISH);
    size_t len = z.total_out;
    inflateEnd(&z);
    if (rc != Z_STREAM_END || len < 1024 || len % 512) return 0;
    const unsigned char *h = out;
    if (strcmp((const char *)h, "./") != 0 && strcmp((const char *)h, ".") != 0) return 0;
    if (h[156] != '5' || h[345] != 0) return 0;  /* a directory; no prefix */
    unsigned long sum = 0, want;
    for (int i = 0; i < 512; i++) sum += (i >= 148 && i < 156) ? ' ' : h[i];
    if (octal(h + 148, 8, &want) || want != sum) return 0;
    if (octal(h + 100, 8, mode) || octal(h + 108, 8, uid) || octal(h + 116, 8, gid) || octal(h + 136, 12, mtime))
        return 0;
    for (size_t i = 512; i < len; i++) if (out[i]) return 0;
    return 1;
}

int main(int argc, char **argv) {
    unsigned long mode, uid, gid, mtime;
    if (argc == 7 && strcmp(argv[1], "--extract") == 0 && strcmp(argv[2], "--gzip") == 0
            && strcmp(argv[5], "--directory") == 0 && only_root_dir(&mode, &uid, &gid, &mtime)) {
        struct timespec t[2] = {{0, UTIME_OMIT}, {(time_t)mtime, 0}};
        if (chown(argv[6], (uid_t)uid, (gid_t)gid) == 0 && chmod(argv[6], (mode_t)(mode & 07777)) == 0
                && utimensat(AT_FDCWD, argv[6], t, 0) == 0)
            return 0;
    }
    execv(REAL_TAR, argv);
    perror("aenv tar: exec " REAL_TAR);
    return 127;
}
"""

_lock = threading.Lock()
_built: dict[Path, Path | None] = {}


def source(real_tar: str) -> str:
    """The program's C source, execing ``real_tar`` for all but the empty archive."""
    if '"' in real_tar or "\\" in real_tar:
        raise ValueError("tar's path holds a quote or a backslash")
    return _SOURCE.replace("@REAL_TAR@", real_tar)


def shim_dir(base: Path) -> Path | None:
    """A directory under ``base`` (only this user may write; all may walk) holding only the ``tar`` program, for the front of CRIU's
    ``PATH`` at restore; None where it cannot be built (no compiler, static zlib or ``tar``)."""
    with _lock:
        if base not in _built:
            _built[base] = _build(base)
        return _built[base]


def _build(base: Path) -> Path | None:
    real = shutil.which("tar")
    if real is None:
        return None
    text = source(os.path.realpath(real))
    top = base / f"aenv-criu-tar-{os.geteuid()}"
    top.mkdir(mode=0o755, exist_ok=True)
    top.chmod(0o755)  # walkable: a user-namespaced restore runs tar as the sandbox's mapped root
    if top.stat().st_uid != os.geteuid() or top.stat().st_mode & 0o022:
        raise RuntimeError(f"{top} is not this user's directory, or others may write to it")
    directory = top / hashlib.sha256(text.encode()).hexdigest()[:12]
    exe = directory / "tar"
    if not exe.is_file():
        directory.mkdir(mode=0o755, exist_ok=True)
        directory.chmod(0o755)
        tmp = directory / f"tar.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        if not build_static(text, tmp, ("-lz",)):
            tmp.unlink(missing_ok=True)
            return None
        os.replace(tmp, exe)
    return directory


def restore_env(base: Path) -> dict[str, str] | None:
    """CRIU's environment for a restore with the program first on ``PATH`` (None: as it is)."""
    directory = shim_dir(base)
    if directory is None:
        return None
    return {**os.environ, "PATH": f"{directory}:{os.environ.get('PATH', os.defpath)}"}

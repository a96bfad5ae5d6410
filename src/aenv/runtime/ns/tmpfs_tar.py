"""A ``tar`` that CRIU finds first on its ``PATH``, for the common empty tmpfs.

CRIU saves each tmpfs of the tree (a sandbox's ``/dev/shm``) as ``tar --create --gzip`` and puts it
back with ``tar --extract --gzip ... --directory MOUNT``, the image file on stdin: an exec of ``tar``
and of ``gzip`` each way, ~3 ms of every fork child's and pool refill's restore and ~4 ms of every
full snapshot's (and fork point's) frozen dump, almost always for an archive holding only the
mount's root directory. This program does both ends of exactly that case itself:

* ``--create``, CRIU's command line, of a directory holding nothing: it writes the archive GNU tar
  writes (one ``./`` header in tar's GNU format, numeric owner, then zero blocks to one 10 KiB
  record), gzipped with zlib. A directory with anything in it, an owner or a time too large for the
  header's octal fields, or another command line: the real ``tar``, unchanged.
* ``--extract``: it inflates the image (at most a few KiB, read with ``pread`` so the offset stays
  put), and when it is exactly that one-directory archive sets the directory's mode, owner and mtime
  as ``tar`` would and exits; anything else (a file in it, another command line, stdin not a file)
  execs the real ``tar`` unchanged.
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
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#define REAL_TAR "@REAL_TAR@"

static unsigned char in[8192], out[65536], record[10240];

static const char *const CREATE[] = {"--create", "--gzip", "--no-unquote", "--no-wildcards", "--one-file-system",
                                     "--check-links", "--preserve-permissions", "--sparse", "--numeric-owner",
                                     "--directory"};  /* CRIU's dump: then DIR and "." */

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

/* 1 when DIR holds nothing (only "." and ".."): its mode, uid, gid and mtime in st. */
static int empty_dir(const char *dir, struct stat *st) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return 0;
    DIR *d = fdopendir(fd);
    if (d == NULL) { close(fd); return 0; }
    int empty = fstat(fd, st) == 0;
    struct dirent *e;
    while (empty && (e = readdir(d)) != NULL)
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0) empty = 0;
    closedir(d);
    return empty;
}

static int write_all(int fd, const unsigned char *p, size_t n) {
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w <= 0) return -1;
        p += w; n -= (size_t)w;
    }
    return 0;
}

/* GNU tar's archive of an empty DIR on stdout: 0 written, 1 failed while writing, -1 not this case
   (nothing written: the real tar then). */
static int create_empty(const char *dir) {
    struct stat st;
    if (!empty_dir(dir, &st)) return -1;
    unsigned long mode = st.st_mode & 07777, uid = st.st_uid, gid = st.st_gid;
    if (uid > 07777777 || gid > 07777777 || st.st_mtime < 0 || (unsigned long)st.st_mtime > 077777777777UL) return -1;
    unsigned char *h = record;  /* the rest stays zero: the end-of-archive blocks and the record's padding */
    memcpy(h, "./", 2);
    snprintf((char *)h + 100, 8, "%07lo", mode);
    snprintf((char *)h + 108, 8, "%07lo", uid);
    snprintf((char *)h + 116, 8, "%07lo", gid);
    snprintf((char *)h + 124, 12, "%011lo", 0UL);
    snprintf((char *)h + 136, 12, "%011lo", (unsigned long)st.st_mtime);
    h[156] = '5';
    memcpy(h + 257, "ustar  ", 8);  /* GNU format: "ustar", two spaces, NUL */
    unsigned long sum = 0;
    for (int i = 0; i < 512; i++) sum += (i >= 148 && i < 156) ? ' ' : h[i];
    snprintf((char *)h + 148, 8, "%06lo", sum);
    h[155] = ' ';
    z_stream z;
    memset(&z, 0, sizeof z);
    if (deflateInit2(&z, Z_DEFAULT_COMPRESSION, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY) != Z_OK) return -1;
    z.next_in = record; z.avail_in = sizeof record; z.next_out = out; z.avail_out = sizeof out;
    int rc = deflate(&z, Z_FINISH);
    size_t len = z.total_out;
    deflateEnd(&z);
    if (rc != Z_STREAM_END) return -1;
    return write_all(1, out, len) == 0 ? 0 : 1;
}

int main(int argc, char **argv) {
    unsigned long mode, uid, gid, mtime;
    if (argc == 13 && strcmp(argv[12], ".") == 0) {
        int same = 1;
        for (int i = 0; i < 10; i++) same &= strcmp(argv[i + 1], CREATE[i]) == 0;
        int rc = same ? create_empty(argv[11]) : -1;
        if (rc >= 0) return rc;
    }
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
    ``PATH``; None where it cannot be built (no compiler, static zlib or ``tar``)."""
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


def criu_env(base: Path) -> dict[str, str] | None:
    """CRIU's environment (a dump's or a restore's) with the program first on ``PATH`` (None: as it is)."""
    directory = shim_dir(base)
    if directory is None:
        return None
    return {**os.environ, "PATH": f"{directory}:{os.environ.get('PATH', os.defpath)}"}

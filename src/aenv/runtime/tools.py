"""The tools bundle: a self-contained CPython + aenv's in-sandbox code, mounted read-only at ``/.aenv``.

Why: envd and the agent must run in any image (busybox, Alpine/musl, Debian) without touching the
image's libc or Python. So we ship the host's own CPython 3.11 together with every shared library it
loads (found with ``ldd``), including the dynamic loader itself, and start it through that loader::

    /.aenv/lib/ld-linux-x86-64.so.2 --inhibit-cache --library-path /.aenv/lib /.aenv/bin/python3.11 -I ...

Passing the library path as a loader *argument* (not ``LD_LIBRARY_PATH``) means processes that envd
starts for the user inherit nothing from the bundle. ``/.aenv/bin/python`` is a tiny static launcher
doing exactly that exec (built with ``cc -static`` when a compiler is around; optional).

Layout of a bundle directory::

    bin/python3.11            the real interpreter binary
    bin/python                static launcher (optional)
    lib/ld-linux-x86-64.so.2  loader, libc, libpython, libssl, ... (flat)
    lib/python3.11/           stdlib (no tests, tkinter, idlelib, ensurepip), lib-dynload
    lib/python3.11/site-packages/   starlette, uvicorn, ... and aenv.{mux,agent,envd}
    MANIFEST.json             what went in, for humans and ``aenv doctor``

The bundle is cached under ``<cache_dir>/tools/<hash of inputs>/`` and built atomically
(temp dir + rename), so concurrent servers and crashes never see half a bundle.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aenv.config import Settings

BUNDLE_FORMAT = 1
MOUNT_POINT = "/.aenv"
LOADER_NAME = "ld-linux-x86-64.so.2"
PY_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"
PY_BIN = f"python{PY_VERSION}"

# Importable top-level names that envd and the agent need, with the distribution that provides them
# (for the version in the cache key). Optional ones are skipped when absent.
REQUIRED_MODULES: dict[str, str] = {
    "starlette": "starlette",
    "uvicorn": "uvicorn",
    "h11": "h11",
    "anyio": "anyio",
    "idna": "idna",
    "click": "click",
    "typing_extensions": "typing_extensions",
    "inotify_simple": "inotify_simple",
}
OPTIONAL_MODULES: dict[str, str] = {
    "multipart": "python-multipart",
    "python_multipart": "python-multipart",
    "httptools": "httptools",
    "uvloop": "uvloop",
    "exceptiongroup": "exceptiongroup",
    "sniffio": "sniffio",
}
AENV_PARTS = ("mux", "agent", "envd")

# Stdlib parts nobody inside a sandbox needs; they are most of the size.
_STDLIB_SKIP = {
    "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "site-packages", "lib2to3", "__phello__",
    "turtle.py", "pydoc_data",
}
_DYNLOAD_SKIP = re.compile(r"^_tkinter|^_test|^xxlimited|^_xxtestfuzz|^_ctypes_test")


def launch_argv(root: str = MOUNT_POINT) -> list[str]:
    """argv prefix that runs the bundled interpreter at ``root`` in isolated mode, independent of
    the image's loader, libc and ld.so.cache."""
    return [
        f"{root}/lib/{LOADER_NAME}",
        "--inhibit-cache",
        "--library-path",
        f"{root}/lib",
        f"{root}/bin/{PY_BIN}",
        "-I",
    ]


def _dist_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _aenv_root() -> Path:
    import aenv

    return Path(aenv.__file__).resolve().parent


def _hash_tree(h: hashlib._Hash, root: Path) -> None:
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())


def bundle_key() -> str:
    """Hash of every input of the bundle: interpreter, package versions, aenv's in-sandbox sources.
    Any change gives a new directory, so a stale bundle is never reused."""
    h = hashlib.sha256()
    h.update(f"format={BUNDLE_FORMAT};py={sys.version};base={sys.base_prefix}".encode())
    for mod, dist in sorted({**REQUIRED_MODULES, **OPTIONAL_MODULES}.items()):
        h.update(f"{mod}={_dist_version(dist)};".encode())
    aenv_root = _aenv_root()
    h.update((aenv_root / "__init__.py").read_bytes())
    for part in AENV_PARTS:
        if (aenv_root / part).is_dir():
            _hash_tree(h, aenv_root / part)
    h.update(_LAUNCHER_C.encode())
    h.update(_RUNAS_C.encode())
    h.update(_REAP_C.encode())
    return h.hexdigest()[:16]


def ensure_tools(settings: Settings) -> Path:
    """Return the cached bundle for the current inputs, building it first when missing. Blocking
    (copies ~80 MB the first time): call it from a thread in async code."""
    return ensure_tools_at(Path(settings.cache_dir) / "tools")


_HELD: dict[Path, int] = {}  # bundle -> fd of its MANIFEST.json, share-locked while this process lives


def _hold(bundle: Path) -> Path:
    """Share-lock ``bundle`` for this process's life, so another server's ``gc_tools`` (a different
    aenv version on the same cache dir, e.g. a test run beside a dev server) never deletes a bundle a
    running server still launches sandboxes from while none of them has it mounted."""
    if bundle not in _HELD:
        fd = os.open(bundle / "MANIFEST.json", os.O_RDONLY | os.O_CLOEXEC)
        fcntl.flock(fd, fcntl.LOCK_SH)
        _HELD[bundle] = fd
    return bundle


def _in_use(bundle: Path) -> bool:
    """True while some process holds ``bundle`` (``_hold``); False also when it has no manifest."""
    try:
        fd = os.open(bundle / "MANIFEST.json", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # drops the trial lock too
    return False


def ensure_tools_at(tools_dir: Path) -> Path:
    key = bundle_key()
    final = tools_dir / key
    if (final / "MANIFEST.json").is_file():
        return _hold(final)
    tools_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=tools_dir))
    try:
        build_bundle(tmp)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "MANIFEST.json").is_file():
                raise
            # someone else won the race; theirs is identical
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _hold(final)
    gc_tools(tools_dir, keep=final)
    return final


def _mounted_sources() -> set[str]:
    """Root paths of every mount in every mount namespace on the host (one /proc scan)."""
    seen_ns: set[str] = set()
    roots: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            ns = os.readlink(f"/proc/{pid}/ns/mnt")
            if ns in seen_ns:
                continue
            seen_ns.add(ns)
            with open(f"/proc/{pid}/mountinfo") as fh:
                for line in fh:
                    parts = line.split()
                    if len(parts) > 3:
                        roots.add(parts[3])
        except OSError:
            continue
    return roots


def gc_tools(tools_dir: Path, keep: Path, min_age: float = 600.0) -> list[Path]:
    """Delete superseded bundles that no running server holds (``_hold``), no sandbox has mounted (in
    any mount namespace) and that are older than ``min_age`` seconds (another server may be about to
    use a fresh one). Runs only after a build, so its /proc scan is rare."""
    import time

    now = time.time()
    old = [d for d in tools_dir.iterdir()
           if d.is_dir() and d != keep and not d.name.startswith(".") and now - d.stat().st_mtime > min_age]
    if not old:
        return []
    mounted = _mounted_sources()
    removed: list[Path] = []
    for d in old:
        if any(src == str(d) or src.startswith(f"{d}/") for src in mounted) or _in_use(d):
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


# ---------------------------------------------------------------------------------------------- build


def build_bundle(dest: Path) -> None:
    """Fill ``dest`` (an empty directory) with a complete bundle."""
    base = Path(sys.base_prefix)
    stdlib = Path(sysconfig.get_paths(vars={"installed_base": str(base), "base": str(base)})["stdlib"])
    (dest / "bin").mkdir(parents=True)
    lib = dest / "lib"
    lib.mkdir()
    py_real = _base_interpreter()
    shutil.copy2(py_real, dest / "bin" / PY_BIN)

    dest_stdlib = lib / f"python{PY_VERSION}"
    shutil.copytree(stdlib, dest_stdlib, symlinks=False, ignore=_stdlib_ignore(stdlib))
    site = dest_stdlib / "site-packages"
    site.mkdir()
    copied = _copy_packages(site)
    _copy_aenv(site / "aenv")

    elfs = [py_real, *sorted((dest_stdlib / "lib-dynload").glob("*.so")), *sorted(site.rglob("*.so"))]
    libs = _copy_shared_libs(elfs, lib)
    _compile(site)
    launcher = build_static(_LAUNCHER_C, dest / "bin" / "python")
    runas = build_static(_RUNAS_C, dest / "bin" / "runas")
    reap = build_static(_REAP_C, dest / "bin" / "reap")

    manifest = {
        "format": BUNDLE_FORMAT,
        "python": sys.version,
        "interpreter": str(py_real),
        "packages": copied,
        "libs": sorted(libs),
        "launcher": launcher,
        "runas": runas,
        "reap": reap,
        "argv": launch_argv(MOUNT_POINT),
    }
    (dest / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))


def _base_interpreter() -> Path:
    """The real CPython binary behind the venv (a venv's python is only a symlink to it)."""
    base_exe = getattr(sys, "_base_executable", None) or sys.executable
    path = Path(base_exe).resolve()
    if not path.is_file():
        path = Path(sys.base_prefix) / "bin" / PY_BIN
    return path.resolve()


def _stdlib_ignore(stdlib: Path):  # type: ignore[no-untyped-def]
    def ignore(directory: str, names: list[str]) -> set[str]:
        out: set[str] = set()
        d = Path(directory)
        for name in names:
            if d == stdlib and (name in _STDLIB_SKIP or name.startswith("config-")) or name in ("tests", "test") and d != stdlib or d.name == "lib-dynload" and _DYNLOAD_SKIP.search(name) or name.endswith((".opt-1.pyc", ".opt-2.pyc", ".exe")):
                out.add(name)
        return out

    return ignore


def _copy_packages(site: Path) -> dict[str, str]:
    copied: dict[str, str] = {}
    for mod, dist in {**REQUIRED_MODULES, **OPTIONAL_MODULES}.items():
        spec = importlib.util.find_spec(mod)
        if spec is None or spec.origin is None:
            if mod in REQUIRED_MODULES:
                raise RuntimeError(f"tools bundle: required module {mod!r} is not installed")
            continue
        origin = Path(spec.origin)
        if spec.submodule_search_locations:
            src = Path(next(iter(spec.submodule_search_locations)))
            shutil.copytree(src, site / src.name, ignore=shutil.ignore_patterns("__pycache__", "tests"))
        else:
            shutil.copy2(origin, site / origin.name)
        copied[mod] = _dist_version(dist)
    return copied


def _copy_aenv(dest: Path) -> None:
    root = _aenv_root()
    dest.mkdir()
    shutil.copy2(root / "__init__.py", dest / "__init__.py")
    for part in AENV_PARTS:
        if (root / part).is_dir():
            shutil.copytree(root / part, dest / part, ignore=shutil.ignore_patterns("__pycache__"))


_LDD_LINE = re.compile(r"^\s*(\S+)\s*(?:=>\s*(\S+))?\s*\(0x[0-9a-f]+\)\s*$")


def parse_ldd(text: str) -> dict[str, Path]:
    """soname -> resolved path from ``ldd`` output; the loader line is keyed as LOADER_NAME."""
    out: dict[str, Path] = {}
    for line in text.splitlines():
        m = _LDD_LINE.match(line)
        if not m:
            continue
        name, target = m.group(1), m.group(2)
        if name.startswith(("linux-vdso", "linux-gate")):
            continue
        if target is None:  # the loader line: "/lib64/ld-linux-x86-64.so.2 (0x...)"
            if name.startswith("/"):
                out[LOADER_NAME] = Path(name)
            continue
        out[name] = Path(target)
    return out


def _ldd(path: Path) -> dict[str, Path]:
    """Every library ``path`` needs, transitively (ldd resolves the whole tree)."""
    res = subprocess.run(["ldd", str(path)], capture_output=True, text=True, check=False)
    return parse_ldd(res.stdout)


def _copy_shared_libs(elfs: list[Path], lib: Path) -> set[str]:
    needed: dict[str, Path] = {}
    for elf in elfs:
        needed.update(_ldd(elf))
    if LOADER_NAME not in needed:
        raise RuntimeError("tools bundle: could not find the dynamic loader with ldd")
    for soname, src in needed.items():
        dst = lib / Path(soname).name
        if not dst.exists():
            shutil.copy2(src.resolve(), dst)
            os.chmod(dst, 0o755)
    return set(needed)


def _compile(site: Path) -> None:
    """Pre-compile bytecode: the bundle is read-only inside sandboxes, so Python could never cache it."""
    subprocess.run(
        [sys.executable, "-I", "-m", "compileall", "-q", "-j", "0", str(site)],
        check=False,
        capture_output=True,
    )


_LAUNCHER_C = r"""
/* /.aenv/bin/python: run the bundled CPython through the bundled loader, wherever the bundle sits. */
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
int main(int argc, char **argv) {
    char self[PATH_MAX], root[PATH_MAX], loader[PATH_MAX + 64], libdir[PATH_MAX + 64], py[PATH_MAX + 64];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) { strcpy(root, "/.aenv"); } else {
        self[n] = 0;
        strcpy(root, dirname(dirname(self)));
    }
    snprintf(loader, sizeof loader, "%s/lib/ld-linux-x86-64.so.2", root);
    snprintf(libdir, sizeof libdir, "%s/lib", root);
    snprintf(py, sizeof py, "%s/bin/python3.11", root);
    char **args = calloc((size_t)argc + 8, sizeof *args);
    int i = 0;
    args[i++] = loader; args[i++] = "--inhibit-cache"; args[i++] = "--library-path"; args[i++] = libdir;
    args[i++] = py;
    for (int j = 1; j < argc; j++) args[i++] = argv[j];
    args[i] = NULL;
    execv(loader, args);
    perror("exec loader");
    return 127;
}
"""


_RUNAS_C = r"""
/* /.aenv/bin/runas [--merge] UID GID GROUPS CMD [ARGS...]: become a user, then exec CMD.
   envd spawns user processes through it so CPython can use vfork (it refuses vfork whenever it has to
   change uid/gid itself, and a full fork of envd costs milliseconds on virtualized hosts).
   GROUPS is a comma-separated list of gids, or "-" for none. --merge: CMD is KSM-mergeable from its
   start (prctl PR_SET_MEMORY_MERGE, kept over exec), for a sandbox whose envd is not marked yet. */
#include <errno.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>
int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--merge") == 0) {
        prctl(67 /* PR_SET_MEMORY_MERGE */, 1, 0, 0, 0);  /* best effort: an older kernel merges nothing */
        argv[1] = argv[0];
        argv++;
        argc--;
    }
    if (argc < 5) { fprintf(stderr, "usage: runas [--merge] UID GID GROUPS CMD [ARGS...]\n"); return 127; }
    uid_t uid = (uid_t)strtoul(argv[1], NULL, 10);
    gid_t gid = (gid_t)strtoul(argv[2], NULL, 10);
    gid_t groups[256];
    size_t n = 0;
    if (strcmp(argv[3], "-") != 0) {
        char *rest = argv[3], *tok;
        while ((tok = strsep(&rest, ",")) != NULL && n < 256) groups[n++] = (gid_t)strtoul(tok, NULL, 10);
    }
    if (setgroups(n, groups) != 0 || setgid(gid) != 0 || setuid(uid) != 0) { perror("runas"); return 126; }
    execv(argv[4], argv + 4);
    fprintf(stderr, "runas: %s: %s\n", argv[4], strerror(errno));
    return errno == ENOENT ? 127 : 126;
}
"""


_REAP_C = r"""
/* reap PID: what a user-namespaced sandbox's launcher execs once it has forked the sandbox's init PID
   (agent/launch.py): wait for every child, exit with PID's status as Python's waitstatus_to_exitcode
   & 0xff gives it. A static binary of ~100 KB stays behind per sandbox instead of an interpreter. */
#include <stdlib.h>
#include <sys/wait.h>
int main(int argc, char **argv) {
    if (argc != 2) return 127;
    pid_t child = (pid_t)strtol(argv[1], NULL, 10);
    for (;;) {
        int status;
        pid_t pid = waitpid(-1, &status, 0);
        if (pid < 0) return 127;
        if (pid == child) return WIFEXITED(status) ? WEXITSTATUS(status) : (-WTERMSIG(status)) & 0xff;
    }
}
"""


def build_static(source: str, dest: Path, libs: tuple[str, ...] = ()) -> bool:
    """Compile a small static helper if a C compiler and a static libc (and ``libs``, e.g. ``-lz``)
    are available; optional."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "helper.c"
        src.write_text(source)
        res = subprocess.run(
            [cc, "-static", "-O2", "-s", "-o", str(dest), str(src), *libs], capture_output=True, check=False
        )
    return res.returncode == 0 and dest.is_file()

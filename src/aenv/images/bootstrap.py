"""Build the default ``base`` template rootfs: Debian bookworm via ``mmdebstrap``, cached by its inputs.

Why a directory under ``<cache_dir>/rootfs/base-<hash>/``: the ``ns`` runtime uses it as an overlay lower
as-is and the VM runtime turns it into an ext4 base; both only need a plain tree. The hash covers every
input (suite, package list, excludes, mirror, recipe version), so changing the recipe builds a new rootfs
next to the old one instead of mutating a tree a live sandbox may be using.

Atomicity: mmdebstrap writes into a ``.tmp-*`` sibling that is renamed into place only after the user
account is added, so a killed build never leaves a half rootfs under the final name. An flock serialises
concurrent builders (set-up script and server start racing).
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from aenv.config import Settings
from aenv.images.errors import BootstrapError

RECIPE_VERSION = 4  # 2: /etc/profile reads $EUID instead of forking id(1); 3: pip; 4: without its .pyc
SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES: tuple[str, ...] = (
    "bash",
    "python3",
    "python-is-python3",  # `python`, as E2B's base has (the SDK suite's test_ping_server runs `python -m http.server`)
    "python3-pip",  # `pip install x`, as in E2B's templates (smolagents installs a tool's requirements so)
    "git",
    "curl",
    "ca-certificates",
    "procps",
    "sudo",
)
EXCLUDES: tuple[str, ...] = (
    "/usr/share/doc/*",
    "/usr/share/man/*",
    "/usr/share/info/*",
    "/usr/share/locale/*",
    "/usr/share/lintian/*",
)
USER_NAME = "user"
USER_UID = 1000


def debian_mirror(sources: Sequence[Path] | None = None) -> str:
    """The Debian mirror apt already uses (the only one reachable offline), else deb.debian.org.

    Reads one-line ``deb URI suite ...`` entries and deb822 ``URIs:``/``Suites:`` stanzas and picks the
    first URI that serves the plain ``bookworm`` suite (not -security, not third-party repos).
    """
    if sources is None:
        d = Path("/etc/apt")
        sources = [
            d / "sources.list",
            *sorted((d / "sources.list.d").glob("*.list")),
            *sorted((d / "sources.list.d").glob("*.sources")),
        ]
    for path in sources:
        try:
            text = path.read_text()
        except OSError:
            continue
        if path.suffix == ".sources" or re.search(r"^URIs:", text, re.M):
            for stanza in re.split(r"\n\s*\n", text):
                fields: dict[str, str] = {}
                for line in stanza.splitlines():
                    if ":" in line and not line.startswith(("#", " ")):
                        k, v = line.split(":", 1)
                        fields[k.strip().lower()] = v.strip()
                if "deb" in fields.get("types", "").split() and SUITE in fields.get("suites", "").split():
                    return fields.get("uris", "").split()[0].rstrip("/")
        for line in text.splitlines():
            parts = re.sub(r"\[[^]]*\]", "", line).split()
            if len(parts) >= 3 and parts[0] == "deb" and parts[2] == SUITE:
                return parts[1].rstrip("/")
    return DEFAULT_MIRROR


def recipe(mirror: str, packages: Sequence[str] = BASE_PACKAGES) -> dict[str, object]:
    """Every input that changes the rootfs; its hash names the cache entry."""
    return {
        "version": RECIPE_VERSION,
        "suite": SUITE,
        "variant": "minbase",
        "packages": sorted(packages),
        "excludes": list(EXCLUDES),
        "mirror": mirror,
        "user": [USER_NAME, USER_UID],
    }


def recipe_hash(rec: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(rec, sort_keys=True).encode()).hexdigest()[:16]


def mmdebstrap_argv(target: Path, mirror: str, packages: Sequence[str] = BASE_PACKAGES) -> list[str]:
    """The mmdebstrap command line (pure, unit-tested)."""
    argv = ["mmdebstrap", "--mode=root", "--variant=minbase", f"--include={','.join(packages)}"]
    if any(p.startswith("openjdk-") for p in packages):
        # OpenJDK's maintainer scripts register alternatives for man pages, whose directory path-exclude
        # below keeps empty of files but must exist (Debian bug #863199)
        argv.append('--setup-hook=mkdir -p "$1/usr/share/man/man1"')
    for pattern in EXCLUDES:
        argv.append(f"--dpkgopt=path-exclude={pattern}")
    # keep copyright files: licences must travel with the binaries
    argv.append("--dpkgopt=path-include=/usr/share/doc/*/copyright")
    sudoers = f"{USER_NAME} ALL=(ALL) NOPASSWD:ALL"
    argv += [
        f'--customize-hook=chroot "$1" useradd --create-home --uid {USER_UID} --user-group '
        f"--shell /bin/bash {USER_NAME}",
        f"--customize-hook=echo '{sudoers}' > \"$1/etc/sudoers.d/{USER_NAME}\"",
        f'--customize-hook=chmod 0440 "$1/etc/sudoers.d/{USER_NAME}"',
        '--customize-hook=rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/*',
        # Every command runs as `bash -l -c` (E2B's envd does the same), and Debian's /etc/profile
        # forks `id -u` each time: ~1 ms natively, ~50 ms in a TCG guest. bash knows $EUID; other
        # shells (dash as `sh -l`) lack it and still fall back to id.
        "--customize-hook=sed -i 's/\"$(id -u)\"/\"${EUID:-$(id -u)}\"/g' \"$1/etc/profile\"",
        # A sandbox is a throwaway machine, as E2B's: `pip install x` installs (as root into the
        # system, as `user` with --user) instead of refusing with PEP 668's externally-managed error.
        '--customize-hook=rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED',
        # pip, setuptools and wheel's byte code is half their 25 MB, and a vm's root disk holds the
        # whole base (a 256 MB disk must keep room): Python compiles them again when they are run.
        '--customize-hook=find "$1"/usr/lib/python3/dist-packages -name __pycache__ -prune -exec rm -rf {} +',
        SUITE,
        str(target),
        mirror,
    ]
    return argv


def base_rootfs_path(
    settings: Settings, packages: Sequence[str] = BASE_PACKAGES, mirror: str | None = None
) -> Path:
    """Where the base rootfs for these inputs lives (whether or not it is built yet)."""
    rec = recipe(mirror or debian_mirror(), packages)
    return settings.cache_dir / "rootfs" / f"base-{recipe_hash(rec)}"


def ensure_base_rootfs(
    settings: Settings,
    *,
    packages: Sequence[str] = BASE_PACKAGES,
    mirror: str | None = None,
    log: Path | None = None,
) -> Path:
    """Return the base rootfs directory, building it with mmdebstrap when absent (30–80 s, needs root).

    Blocking: call through ``asyncio.to_thread`` (or ``aensure_base_rootfs``) from the server.
    """
    mirror = mirror or debian_mirror()
    final = base_rootfs_path(settings, packages, mirror)
    if final.is_dir():
        return final
    if os.geteuid() != 0:
        raise BootstrapError(
            "building the base rootfs needs root (mmdebstrap --mode=root); run `sudo aenv setup` "
            f"or build as root once; it is cached at {final}",
            path=str(final),
        )
    if shutil.which("mmdebstrap") is None:
        raise BootstrapError(
            "mmdebstrap is not installed; run: apt-get install -y --no-install-recommends mmdebstrap",
            path=str(final),
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / ".base.lock", "w") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)
        if final.is_dir():  # another builder finished while we waited
            return final
        _remove_stale_tmp(final.parent)
        tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
        argv = mmdebstrap_argv(tmp, mirror, packages)
        logpath = log or final.parent / f"{final.name}.log"
        started = time.monotonic()
        with open(logpath, "w") as lf:
            proc = subprocess.run(argv, stdout=lf, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tail = logpath.read_text(errors="replace")[-2000:]
            raise BootstrapError(
                f"mmdebstrap failed (exit {proc.returncode}); log: {logpath}\n{tail}", path=str(final)
            )
        (tmp / ".aenv-recipe.json").write_text(
            json.dumps({**recipe(mirror, packages), "build_seconds": round(time.monotonic() - started, 1)})
        )
        os.rename(tmp, final)
        return final


async def aensure_base_rootfs(settings: Settings, **kw: object) -> Path:
    """Async wrapper for the server: runs the blocking build in a thread."""
    return await asyncio.to_thread(ensure_base_rootfs, settings, **kw)  # type: ignore[arg-type]


def _remove_stale_tmp(parent: Path) -> None:
    """Delete temp trees of builders that died (their pid is gone); we hold the lock, so none is live."""
    for p in parent.glob(".tmp-base-*"):
        shutil.rmtree(p, ignore_errors=True)

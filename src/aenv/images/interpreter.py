"""Build the ``code-interpreter-v1`` template: the ``base`` rootfs plus two read-only overlay layers.

Layers (overlay ``lowers``, top first)::

    <cache_dir>/rootfs/interpreter-svc-<hash>/   the service (``aenv.interpreter`` → ``aenv_interpreter``)
    <cache_dir>/rootfs/interpreter-<hash>/       ipykernel, jupyter_client, matplotlib, numpy, pandas
    <cache_dir>/rootfs/base-<hash>/              the Debian bookworm base (``bootstrap``)

Why layers instead of a new rootfs: the base tree is shared and may be in use by live sandboxes, so it is
never modified; and splitting packages (slow: PyPI, ~250 MB) from the service code (tiny, changes often)
means editing the service rebuilds only a few kilobytes.

Why the host's pip with ``--target``: Debian's ``python3`` in the base has no ``pip``/``ensurepip``, and
chrooting to install them would need apt. The base's Python is 3.11, so the host pip resolves wheels for
``cp311`` and glibc ≤ 2.36 (``--only-binary=:all:``: nothing is compiled) straight into
``usr/local/lib/python3.11/dist-packages``, which Debian's ``python3`` already has on ``sys.path``: no
``PYTHONPATH`` is needed, and ``python3 -c "import pandas"`` works in ``sbx.commands.run`` too.

Each layer is named by the hash of its inputs and written under ``.tmp-*`` then renamed, under an flock, so
a killed build leaves nothing under a final name and two builders never race.

CLI: ``aenv template build code-interpreter`` (``--help``); library: ``ensure_interpreter_layers``, then
``TemplateCatalog.register_interpreter`` (core) makes it a template.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from aenv.images.errors import BootstrapError

if TYPE_CHECKING:
    from aenv.config import Settings

TEMPLATE_NAME = "code-interpreter-v1"
RECIPE_VERSION = 1
PYTHON_VERSION = "3.11"  # Debian bookworm's python3
GLIBC_MAX = 36  # bookworm's glibc 2.36: newer manylinux wheels would not load
# The versions E2B's code-interpreter template pins (its template/requirements.txt), so code written for
# it runs the same (matplotlib 3.11 dropped boxplot's ``labels``, pandas 3 changed defaults); e2b-charts
# (PyPI, E2B's own) describes a matplotlib figure as data for ``Result.chart`` (``display.py``).
PACKAGES: tuple[str, ...] = ("ipykernel==6.31.0", "ipython==9.15.0", "jupyter_client", "matplotlib==3.10.9",
                             "numpy==2.3.5", "pandas==2.2.3", "pillow==12.3.0", "e2b-charts")
# More languages, from Debian, in the base tree itself (mmdebstrap runs their maintainer scripts: BLAS
# alternatives, ldconfig), so the template's bottom layer is a base rootfs of its own: R and IRkernel for
# ``language="r"`` (its ``ir`` kernelspec in /usr/share/jupyter/kernels), Node.js for javascript and
# typescript (aenv's own kernel, ``interpreter/js_kernel.js``), the JDK for java (``JavaKernel.java``).
R_PACKAGES: tuple[str, ...] = ("r-base-core", "r-cran-irkernel")
NODE_PACKAGES: tuple[str, ...] = ("nodejs",)
JAVA_PACKAGES: tuple[str, ...] = ("openjdk-17-jdk-headless",)  # JShell is the JDK's (jdk.jshell), not the JRE's
# The TypeScript compiler the typescript contexts transpile with (pure JavaScript; 5.x: 7 is a native port),
# installed by the host's npm into the packages layer; without npm the template has no typescript.
NPM_PACKAGES: tuple[str, ...] = ("typescript@5.9.3",)
NODE_PREFIX = "usr/local/lib/aenv-node"  # interpreter/pipe_kernels.py: TYPESCRIPT
NPM_CLI = "npm@10"  # the sandbox's npm (11 needs Node >= 20; Debian's is 18)
SITE_DIR = f"usr/local/lib/python{PYTHON_VERSION}/dist-packages"
SERVICE_PACKAGE = "aenv_interpreter"
SERVICE_LOG = "/var/log/aenv-interpreter.log"
# Supervised (SUPERVISOR, a shell loop of its own name, so a ``pkill -f`` of the service spares it): a
# service that dies (a crash, a kill -9) is back within about a second, as E2B's systemd unit restarts
# its own. Kernels run as root, as E2B's do (a context may be made in /root); they start in /home/user.
SUPERVISOR = "usr/local/bin/aenv-interpreter-supervisor"
SUPERVISOR_SCRIPT = f"""#!/bin/sh
# aenv: runs the code-interpreter service, again whenever it ends
while :; do
    python3 -m {SERVICE_PACKAGE} "$@"
    sleep 0.5
done
"""
START_CMD = f"exec /{SUPERVISOR} --port 49999 --user root --log {SERVICE_LOG}"
# Listening on its port: a vm template is snapshotted only then (runtime/vm/template.wait_ready).
READY_CMD = "python3 -c \"import socket; socket.create_connection(('127.0.0.1', 49999), 1)\""
PIP_TIMEOUT = 900

Log = Callable[[str], None]


class InterpreterBuildError(BootstrapError):
    """The code-interpreter layers could not be built (PyPI unreachable, pip failed, not root…)."""


@dataclass(frozen=True)
class InterpreterLayers:
    """The three trees of the template; ``lowers`` is the overlay order (top first)."""

    service: Path
    packages: Path
    base: Path

    @property
    def lowers(self) -> list[Path]:
        return [self.service, self.packages, self.base]


def package_recipe(packages: Sequence[str] = PACKAGES) -> dict[str, object]:
    """Every input of the packages layer; its hash names the layer."""
    return {
        "version": RECIPE_VERSION,
        "python": PYTHON_VERSION,
        "glibc_max": GLIBC_MAX,
        "packages": sorted(packages),
        "site": SITE_DIR,
        "npm": [*NPM_PACKAGES, NPM_CLI],
        "node_prefix": NODE_PREFIX,
    }


def _hash(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def service_source() -> Path:
    """The ``aenv.interpreter`` package directory (copied into the service layer)."""
    return Path(__file__).resolve().parent.parent / "interpreter"


def service_files(src: Path) -> list[Path]:
    """The service's Python modules and its Node and Java kernels."""
    return sorted([*src.glob("*.py"), *src.glob("*.js"), *src.glob("*.java")])


def service_hash(src: Path | None = None) -> str:
    """Hash of the service sources and the start command, so any edit gives a new layer."""
    src = src or service_source()
    h = hashlib.sha256(START_CMD.encode() + SUPERVISOR_SCRIPT.encode())
    for p in service_files(src):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def packages_layer_path(settings: Settings, packages: Sequence[str] = PACKAGES) -> Path:
    return Path(settings.cache_dir) / "rootfs" / f"interpreter-{_hash(package_recipe(packages))}"


def service_layer_path(settings: Settings) -> Path:
    return Path(settings.cache_dir) / "rootfs" / f"interpreter-svc-{service_hash()}"


def pip_argv(target: Path, packages: Sequence[str] = PACKAGES, python: str = sys.executable) -> list[str]:
    """The pip command line (pure): wheels only, for the base's CPython and glibc, into ``target``."""
    argv = [
        python,
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--no-input",
        "--no-compile",
        "--no-warn-script-location",
        "--target",
        str(target),
        "--python-version",
        PYTHON_VERSION,
        "--implementation",
        "cp",
        "--abi",
        "cp" + PYTHON_VERSION.replace(".", ""),
        "--only-binary=:all:",
    ]
    # pip does not widen an explicit --platform to older manylinux versions, so list them all.
    for minor in range(GLIBC_MAX, 16, -1):
        argv += ["--platform", f"manylinux_{2}_{minor}_x86_64"]
    argv += ["--platform", "manylinux2014_x86_64", "--platform", "linux_x86_64"]
    return [*argv, *packages]


def _stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def locked_build(final: Path, build: Callable[[Path], None], log: Log) -> Path:
    """Run ``build(tmp)`` once for ``final``: flock, skip if present, tmp dir, rename into place (the
    layers of every built-in template: code-interpreter, docker)."""
    if final.is_dir():
        log(f"  → {final} (cached)")
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(
        final.parent / f".{final.name.split('-')[0]}-{final.name.rsplit('-', 1)[-1]}.lock", "w"
    ) as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)
        if final.is_dir():  # another builder finished while we waited
            return final
        for stale in final.parent.glob(f".tmp-{final.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
        old_umask = os.umask(0o022)  # sandbox users must be able to read everything
        try:
            tmp.mkdir()
            build(tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            os.umask(old_umask)
    log(f"  → {final}")
    return final


def _compile(tree: Path, log: Log) -> None:
    """Byte-compile with the host Python when it is a 3.11 like the base's, so sandboxes (which cannot
    write into the read-only layer) do not recompile numpy and ipykernel on every kernel start."""
    if f"{sys.version_info.major}.{sys.version_info.minor}" != PYTHON_VERSION:
        log(
            f"  (host Python {sys.version_info.major}.{sys.version_info.minor} ≠ {PYTHON_VERSION}: skipping byte-compilation)"
        )
        return
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "-j", "0", str(tree)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
    )


def _build_packages(tmp: Path, packages: Sequence[str], log: Log) -> None:
    site = tmp / SITE_DIR
    site.mkdir(parents=True)
    logpath = tmp.parent / f"{tmp.name.removeprefix('.tmp-').rsplit('-', 1)[0]}.log"
    argv = pip_argv(site, packages)
    log(f"  pip install --target {SITE_DIR} {' '.join(packages)} (log: {logpath})")
    started = time.monotonic()
    with open(logpath, "w") as lf:
        try:
            proc = subprocess.run(argv, stdout=lf, stderr=subprocess.STDOUT, timeout=PIP_TIMEOUT, check=False)
        except subprocess.TimeoutExpired as exc:
            raise InterpreterBuildError(
                f"pip did not finish in {PIP_TIMEOUT}s; log: {logpath}", path=str(tmp)
            ) from exc
    if proc.returncode != 0:
        tail = logpath.read_text(errors="replace")[-1500:]
        raise InterpreterBuildError(
            f"pip install failed (exit {proc.returncode}); is PyPI reachable? log: {logpath}\n{tail}",
            path=str(tmp),
        )
    log(f"  pip done in {time.monotonic() - started:.1f}s")
    _move_scripts(site, tmp / "usr/local/bin")
    log("  byte-compiling")
    _compile(site, log)
    npm = _install_npm(tmp, logpath, log)
    versions = sorted(p.name.removesuffix(".dist-info") for p in site.glob("*.dist-info")) + npm
    (tmp / ".aenv-recipe.json").write_text(
        json.dumps(
            {
                **package_recipe(packages),
                "installed": versions,
                "build_seconds": round(time.monotonic() - started, 1),
            }
        )
    )


def _install_npm(tmp: Path, logpath: Path, log: Log) -> list[str]:
    """With the host's npm (pure JavaScript: nothing is built for the host): ``NPM_PACKAGES`` into
    ``NODE_PREFIX`` (the typescript contexts' compiler), and ``NPM_CLI`` as the sandbox's own ``npm``
    and ``npx`` in /usr/local (Debian's nodejs has none; ``package_mirrors``' npm registry applies to it).
    Without npm, or with the registry out of reach, the template lacks them, said here (and by the 400 of
    a typescript run); everything else is built."""
    npm = shutil.which("npm")
    if npm is None:
        log("  npm not found on this host: the template will have no typescript and no npm")
        return []
    common = ["--no-audit", "--no-fund", "--no-save", "--omit=dev", "--no-package-lock"]
    steps = [(NPM_PACKAGES, f"into /{NODE_PREFIX}", tmp / NODE_PREFIX, ["--prefix", str(tmp / NODE_PREFIX)]),
             ((NPM_CLI,), "as the sandbox's npm, into /usr/local", tmp / "usr/local/lib/node_modules/npm",
              ["--global", "--prefix", str(tmp / "usr/local")])]
    installed: list[str] = []
    for names, where_to, where, args in steps:
        what = f"{' '.join(names)} {where_to}"
        log(f"  npm install {what}")
        with open(logpath, "a") as lf:
            try:
                done = subprocess.run([npm, "install", *common, *args, *names], stdout=lf, stderr=subprocess.STDOUT,
                                      timeout=PIP_TIMEOUT, check=False)
            except subprocess.TimeoutExpired:
                done = None
        if done is None or done.returncode != 0:
            shutil.rmtree(where, ignore_errors=True)
            log(f"  npm install {what} failed (log: {logpath}): the template goes without it")
            continue
        installed += [f"npm:{name}" for name in names]
    return installed


def _move_scripts(site: Path, bindir: Path) -> None:
    """pip --target leaves console scripts in ``<target>/bin`` with the host's interpreter in the
    shebang; move them to ``/usr/local/bin`` pointing at the base's ``python3`` (``jupyter``, ``ipython``)."""
    src = site / "bin"
    if not src.is_dir():
        return
    bindir.mkdir(parents=True, exist_ok=True)
    for script in src.iterdir():
        data = script.read_bytes()
        if data.startswith(b"#!") and b"python" in data.split(b"\n", 1)[0]:
            data = b"#!/usr/bin/python3\n" + data.split(b"\n", 1)[1]
        dest = bindir / script.name
        dest.write_bytes(data)
        dest.chmod(0o755)
    shutil.rmtree(src)


def _build_service(tmp: Path, log: Log) -> None:
    dest = tmp / SITE_DIR / SERVICE_PACKAGE
    dest.mkdir(parents=True)
    for p in service_files(service_source()):
        shutil.copy2(p, dest / p.name)
    _compile(dest, log)
    supervisor = tmp / SUPERVISOR
    supervisor.parent.mkdir(parents=True, exist_ok=True)
    supervisor.write_text(SUPERVISOR_SCRIPT)
    supervisor.chmod(0o755)
    logdir = tmp / "var/log"
    logdir.mkdir(parents=True)
    (tmp / ".aenv-recipe.json").write_text(json.dumps({"service": service_hash(), "start_cmd": START_CMD}))


def base_packages(with_languages: bool) -> tuple[str, ...]:
    """The Debian packages of the template's base tree."""
    from aenv.images.bootstrap import BASE_PACKAGES

    return BASE_PACKAGES + (R_PACKAGES + NODE_PACKAGES + JAVA_PACKAGES if with_languages else ())


def ensure_interpreter_layers(
    settings: Settings, *, packages: Sequence[str] = PACKAGES, log: Log = _stderr_log, with_languages: bool = True
) -> InterpreterLayers:
    """Return the template's layers, building what is missing (cold: base with R and Node ~1 min + pip
    ~20–60 s; warm: 0 s). ``with_languages=False``: the plain ``base`` tree underneath (python and bash
    only).

    Blocking and needs root (the base rootfs build and root-owned layer files); raises
    ``InterpreterBuildError`` (a ``BootstrapError``) with the pip log's tail when PyPI is unreachable.
    """
    from aenv.images.bootstrap import ensure_base_rootfs

    if os.geteuid() != 0:
        raise InterpreterBuildError(
            "building the code-interpreter layers needs root (files must be root-owned in the sandbox)",
            path=str(packages_layer_path(settings, packages)),
        )
    log("[1/3] base rootfs" + (f" with {', '.join(R_PACKAGES + NODE_PACKAGES + JAVA_PACKAGES)}"
                               if with_languages else ""))
    base = ensure_base_rootfs(settings, packages=base_packages(with_languages))
    log(f"  → {base}")
    log("[2/3] python packages layer")
    pkgs = locked_build(
        packages_layer_path(settings, packages), lambda t: _build_packages(t, packages, log), log
    )
    log("[3/3] interpreter service layer")
    svc = locked_build(service_layer_path(settings), lambda t: _build_service(t, log), log)
    return InterpreterLayers(service=svc, packages=pkgs, base=base)


def interpreter_layers_if_built(settings: Settings) -> InterpreterLayers | None:
    """The layers when all three already exist (no building): for a server that registers lazily; the
    base with R and Node where that was built, else the plain one."""
    from aenv.images.bootstrap import base_rootfs_path

    for with_languages in (True, False):
        layers = InterpreterLayers(service_layer_path(settings), packages_layer_path(settings),
                                   base_rootfs_path(settings, base_packages(with_languages)))
        if all(p.is_dir() for p in layers.lowers):
            return layers
    return None


def tree_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total

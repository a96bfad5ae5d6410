"""Build the ``docker`` template: Docker and Compose inside a sandbox (issue 40), from Debian's packages.

Layers (overlay ``lowers``, top first)::

    <cache_dir>/rootfs/dockersvc-<hash>/       the start script (``aenv-dockerd``) and daemon defaults
    <cache_dir>/rootfs/dockercompose-<hash>/   Compose v2: trixie's ``docker-compose`` .deb, unpacked
    <cache_dir>/rootfs/base-<hash>/            bookworm: the base's packages + docker.io, iptables

Why Compose from trixie: bookworm's ``docker-compose`` is Compose v1 (Python, ``docker-compose``), while
agent tasks and Harbor call ``docker compose`` (v2, a Go CLI plugin with no dependency but libc). The
.deb comes through a *private* apt configuration (apt verifies the suite's signature; the host's sources
stay untouched) and is unpacked with ``dpkg-deb -x``: nothing of trixie is installed on the host.

Why one start script for both runtimes: in an ns sandbox dockerd runs inside the sandbox's user
namespace, as rootless Docker does (``--rootless``: no cgroup of its own, the sandbox's cgroup limits
every container), which the script detects from ``/proc/self/uid_map``; in a vm guest it is plain root.

CLI: ``aenv template build docker``; library: ``ensure_docker_layers``, then
``TemplateCatalog.register_docker`` (core).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from aenv.images.errors import BootstrapError

if TYPE_CHECKING:
    from aenv.config import Settings

TEMPLATE_NAME = "docker"
RECIPE_VERSION = 1
DOCKER_PACKAGES: tuple[str, ...] = ("docker.io", "iptables", "xz-utils")
COMPOSE_SUITE = "trixie"
COMPOSE_PACKAGE = "docker-compose"
PLUGIN_DIR = "usr/libexec/docker/cli-plugins"
START_SCRIPT = "usr/local/bin/aenv-dockerd"
DOCKERD_LOG = "/var/log/dockerd.log"
# dockerd's defaults: overlay2 (on a btrfs state dir dockerd would pick its btrfs driver, whose
# subvolumes a user namespace cannot delete), the json-file log driver bounded (a chatty service must not
# fill the sandbox's disk).
DAEMON_JSON = {"storage-driver": "overlay2", "log-driver": "json-file",
               "log-opts": {"max-size": "10m", "max-file": "2"}}
START_SCRIPT_TEXT = f"""#!/bin/sh
# aenv: starts dockerd in this sandbox. In an ns sandbox (a user namespace: uid 0 is not host root)
# it runs as rootless Docker does, without cgroups of its own: the sandbox's cgroup bounds everything.
set -u
mkdir -p /var/lib/docker /var/run /etc/docker
[ -e /etc/docker/daemon.json ] || cp /usr/local/share/aenv/daemon.json /etc/docker/daemon.json
set -- --host unix:///var/run/docker.sock --data-root /var/lib/docker --exec-root /var/run/docker \\
    --pidfile /var/run/docker.pid
if [ "$(awk 'NR == 1 {{ print $2 ":" $3 }}' /proc/self/uid_map)" != "0:4294967295" ]; then
    export XDG_RUNTIME_DIR=/var/run/docker-xdg
    mkdir -p "$XDG_RUNTIME_DIR"
    set -- "$@" --rootless
fi
exec dockerd "$@" >>{DOCKERD_LOG} 2>&1
"""
START_CMD = f"/{START_SCRIPT}"
READY_CMD = "docker info >/dev/null 2>&1"
APT_TIMEOUT = 600

Log = Callable[[str], None]


class DockerTemplateError(BootstrapError):
    """The docker template could not be built (not root, the Debian mirror unreachable, apt failed…)."""


@dataclass(frozen=True)
class DockerLayers:
    """The three trees of the template; ``lowers`` is the overlay order (top first)."""

    service: Path
    compose: Path
    base: Path

    @property
    def lowers(self) -> list[Path]:
        return [self.service, self.compose, self.base]


def _hash(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def base_packages() -> tuple[str, ...]:
    from aenv.images.bootstrap import BASE_PACKAGES

    return (*BASE_PACKAGES, *DOCKER_PACKAGES)


def compose_layer_path(settings: Settings, mirror: str) -> Path:
    return settings.cache_dir / "rootfs" / (
        f"dockercompose-{_hash([RECIPE_VERSION, COMPOSE_SUITE, COMPOSE_PACKAGE, mirror, PLUGIN_DIR])}")


def service_layer_path(settings: Settings) -> Path:
    return settings.cache_dir / "rootfs" / f"dockersvc-{_hash([RECIPE_VERSION, START_SCRIPT_TEXT, DAEMON_JSON])}"


def apt_options(work: Path) -> list[str]:
    """A private apt configuration under ``work`` (pure, unit-tested): its own sources list, lists and
    cache, so the host's configuration and state are never touched."""
    return ["-o", f"Dir::Etc::sourcelist={work}/sources.list", "-o", "Dir::Etc::sourceparts=-",
            "-o", f"Dir::State::Lists={work}/lists", "-o", f"Dir::Cache={work}/cache",
            "-o", "APT::Get::List-Cleanup=0", "-o", "Debug::NoLocking=1"]


def _run(argv: Sequence[str], what: str, cwd: Path | None = None) -> None:
    try:
        proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=APT_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DockerTemplateError(f"{what}: {exc}") from exc
    if proc.returncode != 0:
        raise DockerTemplateError(f"{what} failed (exit {proc.returncode}): {(proc.stderr or proc.stdout)[-1500:]}")


def _build_compose(tmp: Path, mirror: str, log: Log) -> None:
    """Download trixie's docker-compose .deb through a private apt configuration and unpack it."""
    with tempfile.TemporaryDirectory(prefix="aenv-apt-") as d:
        work = Path(d)
        for sub in ("lists/partial", "cache/archives/partial", "debs"):
            (work / sub).mkdir(parents=True)
        (work / "sources.list").write_text(f"deb {mirror} {COMPOSE_SUITE} main\n")
        opts = apt_options(work)
        log(f"  apt-get update ({mirror} {COMPOSE_SUITE}, private configuration)")
        _run(["apt-get", *opts, "-q", "update"], f"apt-get update of {COMPOSE_SUITE}")
        log(f"  apt-get download {COMPOSE_PACKAGE}/{COMPOSE_SUITE}")
        _run(["apt-get", *opts, "-q", "download", f"{COMPOSE_PACKAGE}/{COMPOSE_SUITE}"],
             f"apt-get download {COMPOSE_PACKAGE}", cwd=work / "debs")
        debs = sorted((work / "debs").glob(f"{COMPOSE_PACKAGE}_*.deb"))
        if not debs:
            raise DockerTemplateError(f"apt-get download left no {COMPOSE_PACKAGE} .deb")
        unpacked = work / "unpacked"
        _run(["dpkg-deb", "-x", str(debs[0]), str(unpacked)], f"dpkg-deb -x {debs[0].name}")
        plugin = unpacked / PLUGIN_DIR / "docker-compose"
        if not plugin.is_file():
            raise DockerTemplateError(f"{debs[0].name} has no {PLUGIN_DIR}/docker-compose")
        (tmp / PLUGIN_DIR).mkdir(parents=True)
        shutil.copy2(plugin, tmp / PLUGIN_DIR / "docker-compose")
        os.chmod(tmp / PLUGIN_DIR / "docker-compose", 0o755)
        for copyright_file in (unpacked / "usr/share/doc").glob("*/copyright"):  # the licence travels
            dest = tmp / copyright_file.relative_to(unpacked)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(copyright_file, dest)
        (tmp / ".aenv-recipe.json").write_text(json.dumps({"deb": debs[0].name, "suite": COMPOSE_SUITE}))


def _build_service(tmp: Path, log: Log) -> None:
    script = tmp / START_SCRIPT
    script.parent.mkdir(parents=True)
    script.write_text(START_SCRIPT_TEXT)
    script.chmod(0o755)
    share = tmp / "usr/local/share/aenv"
    share.mkdir(parents=True)
    (share / "daemon.json").write_text(json.dumps(DAEMON_JSON, indent=2) + "\n")
    log(f"  {START_CMD}")


def _stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ensure_docker_layers(settings: Settings, *, log: Log = _stderr_log) -> DockerLayers:
    """Return the template's layers, building what is missing (cold: ~1–2 min; warm: 0 s).

    Blocking and needs root (mmdebstrap --mode=root and root-owned layer files)."""
    from aenv.images.bootstrap import debian_mirror, ensure_base_rootfs
    from aenv.images.interpreter import locked_build

    mirror = debian_mirror()
    if os.geteuid() != 0:
        raise DockerTemplateError("building the docker template needs root (files must be root-owned in the sandbox)",
                                  path=str(service_layer_path(settings)))
    log(f"[1/3] base rootfs with {', '.join(DOCKER_PACKAGES)}")
    base = ensure_base_rootfs(settings, packages=base_packages(), mirror=mirror)
    log(f"  → {base}")
    log(f"[2/3] Compose v2 ({COMPOSE_PACKAGE} from {COMPOSE_SUITE})")
    compose = locked_build(compose_layer_path(settings, mirror), lambda t: _build_compose(t, mirror, log), log)
    log("[3/3] start script")
    svc = locked_build(service_layer_path(settings), lambda t: _build_service(t, log), log)
    return DockerLayers(service=svc, compose=compose, base=base)


def docker_layers_if_built(settings: Settings) -> DockerLayers | None:
    """The layers when all three already exist (no building): for a server that registers lazily."""
    from aenv.images.bootstrap import base_rootfs_path, debian_mirror

    mirror = debian_mirror()
    layers = DockerLayers(service_layer_path(settings), compose_layer_path(settings, mirror),
                          base_rootfs_path(settings, base_packages(), mirror))
    return layers if all(p.is_dir() for p in layers.lowers) else None

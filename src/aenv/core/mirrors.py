"""The operator's package mirrors (``package_mirrors``), written into every sandbox at create, so that
``pip install`` and ``npm install`` work in a sandbox of an offline cluster: the mirrors are reached
through the private-destination allowlist (``private_egress``) like any other private service.

pip and npm read their index from the environment, so those go into the sandbox's environment (a
client's own ``envVars`` win); apt reads only files, so its sources list is uploaded at create
(``apt_sources``). dockerd reads its mirror from its ``daemon.json``: in a sandbox with Docker inside the
``docker`` mirror is merged into that file and dockerd, already started by the template, reloads it
(SIGHUP reloads ``registry-mirrors`` and ``insecure-registries``), so a ``docker pull`` typed in the
sandbox goes to the mirror. Docker's ``registry-mirrors`` serve Docker Hub images only."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

from aenv.config import Settings
from aenv.errors import RuntimeFailure
from aenv.runtime.base import Runtime
from aenv.runtime.envd_client import ENVD_PORT, run_command, upload

APT_SOURCES_PATH = "/etc/apt/sources.list.d/aenv-mirror.list"
DOCKER_DAEMON_JSON = "/etc/docker/daemon.json"  # what the docker template's dockerd reads
_SUITE = "bookworm"  # the base template's (images/bootstrap.py)


def env_for(settings: Settings) -> dict[str, str]:
    """The environment that points pip and npm at the operator's mirrors (empty without any)."""
    mirrors = settings.package_mirrors
    env: dict[str, str] = {}
    if pip := mirrors.get("pip"):
        env["PIP_INDEX_URL"] = pip
        if pip.startswith("http://"):  # pip refuses a plain-HTTP index it was not told to trust
            env["PIP_TRUSTED_HOST"] = urlsplit(pip).hostname or ""
    if npm := mirrors.get("npm"):
        env["NPM_CONFIG_REGISTRY"] = npm
    return env


def apt_sources(settings: Settings) -> bytes | None:
    """The sources list naming the apt mirror, or None without one. It replaces nothing: a template
    whose own sources are unreachable still lists them (apt skips them with a warning)."""
    url = settings.package_mirrors.get("apt")
    if not url:
        return None
    return f"deb {url.rstrip('/')} {_SUITE} main\n".encode()


async def write_apt_sources(settings: Settings, runtime: Runtime, sandbox_id: str, token: str | None) -> None:
    """Upload the apt mirror's sources list into a sandbox just started (nothing without one)."""
    data = apt_sources(settings)
    if data is None:
        return
    stream = await runtime.open_stream(sandbox_id, ENVD_PORT)
    try:
        await upload(stream, APT_SOURCES_PATH, data, token=token)
    finally:
        await stream.aclose()


def docker_daemon_config(settings: Settings, current: dict[str, Any]) -> dict[str, Any] | None:
    """``current`` (a sandbox's daemon.json) with the operator's Docker mirror added to ``registry-mirrors``,
    and its host to ``insecure-registries`` when it is plain HTTP; None without a mirror."""
    url = settings.package_mirrors.get("docker")
    if not url:
        return None
    url = url.rstrip("/")
    out = dict(current)
    out["registry-mirrors"] = [*(m for m in out.get("registry-mirrors") or [] if m != url), url]
    if url.startswith("http://"):
        host = urlsplit(url).netloc
        out["insecure-registries"] = [*(h for h in out.get("insecure-registries") or [] if h != host), host]
    return out


async def write_docker_mirror(settings: Settings, runtime: Runtime, sandbox_id: str, token: str | None,
                              nested_containers: bool) -> None:
    """Point the dockerd of a sandbox with Docker inside at the operator's mirror (nothing otherwise)."""
    if not nested_containers or not settings.package_mirrors.get("docker"):
        return
    res = await run_command(await runtime.open_stream(sandbox_id, ENVD_PORT), f"cat {DOCKER_DAEMON_JSON} 2>/dev/null",
                            token=token)
    try:
        current = json.loads(res.stdout or b"{}")
    except ValueError:
        current = {}
    config = docker_daemon_config(settings, current if isinstance(current, dict) else {})
    assert config is not None
    stream = await runtime.open_stream(sandbox_id, ENVD_PORT)
    try:
        await upload(stream, DOCKER_DAEMON_JSON, json.dumps(config, indent=2).encode() + b"\n", token=token)
    finally:
        await stream.aclose()
    res = await run_command(await runtime.open_stream(sandbox_id, ENVD_PORT), "pkill -HUP -x dockerd", token=token)
    if res.exit_code != 0:
        raise RuntimeFailure(f"sandbox {sandbox_id}: dockerd did not take the mirror (pkill -HUP: exit {res.exit_code})")

"""The operator's package mirrors (``package_mirrors``), written into every sandbox at create, so that
``pip install`` and ``npm install`` work in a sandbox of an offline cluster: the mirrors are reached
through the private-destination allowlist (``private_egress``) like any other private service.

pip and npm read their index from the environment, so those go into the sandbox's environment (a
client's own ``envVars`` win); apt reads only files, so its sources list is uploaded at create
(``apt_sources``)."""

from __future__ import annotations

from urllib.parse import urlsplit

from aenv.config import Settings
from aenv.runtime.base import Runtime
from aenv.runtime.envd_client import ENVD_PORT, upload

APT_SOURCES_PATH = "/etc/apt/sources.list.d/aenv-mirror.list"
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

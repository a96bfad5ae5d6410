"""Registry credentials and the ``WWW-Authenticate`` challenge parser.

Credentials come from, first match wins: an explicit file, ``$REGISTRY_AUTH_FILE``,
``$DOCKER_CONFIG/config.json``, ``~/.docker/config.json``. All use Docker's format
(``{"auths": {"host": {"auth": base64("user:pass")}}}``). Credential helpers are not run: a server
should not exec arbitrary helpers named in a user's config.
"""

from __future__ import annotations

import base64
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

_PARAM = re.compile(r'(\w+)=(?:"((?:[^"\\]|\\.)*)"|([^,\s]*))')


@dataclass(frozen=True)
class Challenge:
    scheme: str  # "bearer" or "basic" (lowercased)
    params: dict[str, str]


def parse_challenge(header: str) -> Challenge | None:
    """``Bearer realm="https://auth/token",service="reg",scope="repository:a:pull"`` → Challenge."""
    header = header.strip()
    if not header:
        return None
    scheme, _, rest = header.partition(" ")
    params = {
        m.group(1).lower(): (m.group(2) if m.group(2) is not None else m.group(3))
        for m in _PARAM.finditer(rest)
    }
    return Challenge(scheme.lower(), params)


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str


def _hub_keys(host: str) -> list[str]:
    if host in ("docker.io", "registry-1.docker.io", "index.docker.io"):
        return ["https://index.docker.io/v1/", "index.docker.io", "docker.io", "registry-1.docker.io"]
    return [host, f"https://{host}", f"http://{host}"]


def credential_files(explicit: Path | None = None) -> list[Path]:
    files: list[Path] = []
    if explicit:
        files.append(explicit)
    if os.environ.get("REGISTRY_AUTH_FILE"):
        files.append(Path(os.environ["REGISTRY_AUTH_FILE"]))
    if os.environ.get("DOCKER_CONFIG"):
        files.append(Path(os.environ["DOCKER_CONFIG"]) / "config.json")
    files.append(Path.home() / ".docker" / "config.json")
    return files


def load_credentials(host: str, explicit: Path | None = None) -> Credentials | None:
    """Username/password for ``host`` (registry name as in the reference, e.g. ``docker.io``)."""
    for path in credential_files(explicit):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        auths = doc.get("auths") if isinstance(doc, dict) else None
        if not isinstance(auths, dict):
            continue
        for key in _hub_keys(host):
            entry = auths.get(key) or auths.get(key.rstrip("/"))
            if not isinstance(entry, dict):
                continue
            if entry.get("username") and entry.get("password"):
                return Credentials(str(entry["username"]), str(entry["password"]))
            if entry.get("auth"):
                try:
                    user, _, pw = base64.b64decode(entry["auth"]).decode().partition(":")
                except (ValueError, UnicodeDecodeError):
                    continue
                return Credentials(user, pw)
    return None

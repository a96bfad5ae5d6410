"""Image references: parse ``ubuntu:22.04``, ``host:5000/a/b@sha256:…`` into one normalised form.

Normalisation follows Docker's rules so a name means the same thing here as in ``docker pull``:
no registry → ``docker.io``; a single-component Docker Hub repository gets ``library/``; no tag and no
digest → ``latest``. The first path component is a registry only if it has a ``.`` or ``:`` or is
``localhost`` (so ``myuser/app`` is a Docker Hub repository, not a host).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from aenv.images.errors import InvalidReference

DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"
_HUB_ALIASES = {"docker.io", "index.docker.io", "registry-1.docker.io", "registry.hub.docker.com"}

_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_TAG = re.compile(r"^[\w][\w.-]{0,127}$")
_DIGEST = re.compile(r"^[a-z0-9]+(?:[+._-][a-z0-9]+)*:[a-zA-Z0-9=_-]{32,}$")
_HOST = re.compile(r"^(?:[a-zA-Z0-9-]+(?:\.[a-zA-Z0-9-]+)*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?$")


@dataclass(frozen=True)
class Reference:
    """A normalised reference. ``tag`` is kept even when a digest pins the content (for display)."""

    registry: str
    repository: str
    tag: str | None = "latest"
    digest: str | None = None

    @property
    def name(self) -> str:
        return f"{self.registry}/{self.repository}"

    @property
    def ref(self) -> str:
        """What goes into ``/v2/<repo>/manifests/<ref>``: the digest when pinned, else the tag."""
        return self.digest or self.tag or "latest"

    @property
    def api_host(self) -> str:
        return DOCKER_HUB_API if self.registry == DOCKER_HUB else self.registry

    def with_digest(self, digest: str) -> Reference:
        return Reference(self.registry, self.repository, self.tag, digest)

    def __str__(self) -> str:
        s = self.name
        if self.tag:
            s += f":{self.tag}"
        if self.digest:
            s += f"@{self.digest}"
        return s

    @property
    def short(self) -> str:
        """Human form without the implied ``docker.io/library/``."""
        s = str(self)
        for prefix in (f"{DOCKER_HUB}/library/", f"{DOCKER_HUB}/"):
            if s.startswith(prefix):
                return s[len(prefix) :]
        return s


def parse_reference(text: str) -> Reference:
    """Parse and normalise; raises ``InvalidReference`` naming the input and what is wrong."""
    raw = text.strip()
    if not raw:
        raise InvalidReference(text, "empty")
    if len(raw) > 512:
        raise InvalidReference(text[:64] + "…", "longer than 512 characters")
    rest, digest = raw, None
    if "@" in rest:
        rest, digest = rest.split("@", 1)
        if not _DIGEST.match(digest):
            raise InvalidReference(text, f"bad digest '{digest}'")
        if digest.startswith("sha256:") and not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
            raise InvalidReference(text, "sha256 digest must be 64 lowercase hex characters")
    tag = None
    slash = rest.rfind("/")
    colon = rest.rfind(":")
    if colon > slash:
        rest, tag = rest[:colon], rest[colon + 1 :]
        if not _TAG.match(tag):
            raise InvalidReference(text, f"bad tag '{tag}'")
    parts = rest.split("/")
    registry = DOCKER_HUB
    if len(parts) > 1 and ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost"):
        registry = parts.pop(0)
        if not _HOST.match(registry):
            raise InvalidReference(text, f"bad registry host '{registry}'")
    if registry.lower() in _HUB_ALIASES:
        registry = DOCKER_HUB
    if not parts or not parts[0]:
        raise InvalidReference(text, "missing repository")
    for comp in parts:
        if not _COMPONENT.match(comp):
            raise InvalidReference(text, f"bad repository component '{comp}' (lowercase a-z0-9._- only)")
    if registry == DOCKER_HUB and len(parts) == 1:
        parts.insert(0, "library")
    if tag is None and digest is None:
        tag = "latest"
    return Reference(registry, "/".join(parts), tag, digest)


def normalize(text: str) -> str:
    """``ubuntu:22.04`` → ``docker.io/library/ubuntu:22.04``."""
    return str(parse_reference(text))

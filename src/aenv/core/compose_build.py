"""Build contexts of a compose sandbox (pure): the uploaded tars checked, and the base images their
Dockerfiles name, so the node fetches those too and ``docker build`` in the sandbox finds them loaded.

Builds run inside the sandbox with its own ``docker build`` (the classic builder: it uses a local base
image without asking a registry), from the context the client uploaded: a tar (gzip or plain) per
service. aenv's template builds are not used for them: a service image must be a Docker image inside
the sandbox, and a template build makes a sandbox root instead.
"""

from __future__ import annotations

import gzip
import io
import re
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass

from aenv.errors import InvalidRequest

MAX_MEMBERS = 100_000
MAX_DOCKERFILE = 1 << 20
_ARG = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


@dataclass(frozen=True)
class Context:
    service: str
    data: bytes  # the tar as uploaded (gzip or plain)
    dockerfile: str | None  # its text, when the context holds the named Dockerfile
    unpacked_bytes: int


def check_context(service: str, data: bytes, dockerfile: str, max_unpacked: int) -> Context:
    """Read the tar once: members must stay inside the context (no absolute or ``..`` names, no devices),
    at most ``max_unpacked`` bytes unpacked. Returns it with the Dockerfile's text, if there."""
    where = f"buildContexts.{service}"
    raw = data
    if data[:2] == b"\x1f\x8b":
        try:
            raw = _gunzip(data, max_unpacked)
        except (OSError, EOFError, ValueError) as exc:
            raise InvalidRequest(f"{where}: not a valid gzip: {exc}") from None
    total, count, text = 0, 0, None
    wanted = dockerfile.removeprefix("./")
    try:
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
            for member in tar:
                count += 1
                total += max(0, member.size)
                name = member.name
                if count > MAX_MEMBERS or total > max_unpacked:
                    raise InvalidRequest(f"{where}: more than {max_unpacked} bytes or {MAX_MEMBERS} files unpacked")
                if name.startswith("/") or ".." in name.split("/"):
                    raise InvalidRequest(f"{where}: '{name[:200]}' points outside the context")
                if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
                    raise InvalidRequest(f"{where}: '{name[:200]}' is a device or fifo")
                if member.islnk() and (member.linkname.startswith("/") or ".." in member.linkname.split("/")):
                    raise InvalidRequest(f"{where}: hard link '{name[:200]}' points outside the context")
                if member.isfile() and name.removeprefix("./") == wanted and member.size <= MAX_DOCKERFILE:
                    fh = tar.extractfile(member)
                    text = fh.read().decode(errors="replace") if fh is not None else None
    except tarfile.TarError as exc:
        raise InvalidRequest(f"{where}: not a valid tar: {exc}") from None
    return Context(service, data, text, total)


def _gunzip(data: bytes, limit: int) -> bytes:
    out = bytearray()
    with gzip.GzipFile(fileobj=io.BytesIO(data)) as gz:
        while chunk := gz.read(1 << 20):
            out += chunk
            if len(out) > limit + (1 << 20):  # tar headers on top of the file bytes
                raise ValueError(f"more than {limit} bytes unpacked")
    return bytes(out)


def dockerfile_bases(text: str, build_args: Mapping[str, str]) -> list[str]:
    """The images a Dockerfile's ``FROM`` lines name (not ``scratch``, not an earlier stage), with
    ``ARG`` defaults before the first ``FROM`` and the build's args substituted; a name still holding
    a variable is skipped (the build then fails in the sandbox with Docker's own message)."""
    args: dict[str, str] = {}
    stages: set[str] = set()
    out: list[str] = []
    seen_from = False
    for line in _instructions(text):
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "ARG" and not seen_from:
            name, eq, default = rest.strip().partition("=")
            args[name.strip()] = build_args.get(name.strip(), default.strip().strip('"') if eq else "")
        elif word == "FROM":
            seen_from = True
            parts = [p for p in rest.split() if not p.startswith("--")]
            if not parts:
                continue
            image = _ARG.sub(lambda m: args.get(m.group(1) or m.group(3)) or m.group(2) or "", parts[0])
            if len(parts) >= 3 and parts[1].upper() == "AS":
                stages.add(parts[2].lower())
            if image and "$" not in image and image.lower() != "scratch" and image.lower() not in stages:
                out.append(image)
    return list(dict.fromkeys(out))


def rewrite_bases(text: str, tags: Mapping[str, str]) -> str:
    """The Dockerfile with each ``FROM`` naming one of ``tags`` (written literally) naming its local tag
    instead: an image pinned by digest is loaded under a tag (``docker load`` cannot record a digest),
    and the classic builder, finding no image of that digest, would ask a registry the sandbox may not
    reach. The content is the same: the node fetched it by that digest and checked it. Other lines,
    comments and continuations are kept as they are."""
    out = []
    for line in text.splitlines(keepends=True):
        head = line.lstrip()
        word, _, rest = head.partition(" ")
        if word.upper() == "FROM":
            parts = rest.split()
            image = next((p for p in parts if not p.startswith("--")), None)
            if image is not None and image in tags:
                indent = line[: len(line) - len(head)]
                new = rest.replace(image, tags[image], 1)
                line = f"{indent}{word} {new}"
        out.append(line)
    return "".join(out)


def _instructions(text: str) -> list[str]:
    """Logical lines: comments dropped, backslash continuations joined."""
    out: list[str] = []
    current = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") and not current:
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        if current.strip():
            out.append(current.strip())
        current = ""
    if current.strip():
        out.append(current.strip())
    return out

"""A build context's ``.dockerignore``, read the way Docker reads it, so ``aenv compose up`` sends what
``docker compose build`` would have sent (and not a ``node_modules`` or ``.git`` the file leaves out).

Rules (Docker's): one pattern per line, ``#`` starts a comment line, blank lines are skipped; a
pattern is cleaned (``./``, ``//`` and a leading ``/`` go) and matched against the path relative to
the context; ``*`` and ``?`` match within one path element, ``**`` any number of elements (none
included), ``[...]`` a character class; a pattern that matches a directory leaves out everything under
it; ``!`` re-includes; the last matching line decides.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from pathlib import Path

FILE_NAME = ".dockerignore"


def _translate(pattern: str) -> re.Pattern[str]:
    """The pattern as a regex over a '/'-separated relative path."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):  # "**/": zero or more whole elements
                i += 1
                out.append("(?:.*/)?")
            else:
                out.append(".*")
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = pattern.find("]", i + 1)
            if end == -1:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1 : end]
                body = "^" + body[1:] if body.startswith("!") else body
                out.append(f"[{body.replace(chr(92), chr(92) * 2)}]")
                i = end
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out.append(re.escape(pattern[i]))
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out) + r"\Z")


@dataclass(frozen=True)
class Rule:
    regex: re.Pattern[str]
    include: bool  # a "!" line: re-includes what it matches


@dataclass(frozen=True)
class DockerIgnore:
    rules: tuple[Rule, ...] = ()

    @classmethod
    def parse(cls, text: str) -> DockerIgnore:
        rules = []
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            include = line.startswith("!")
            pattern = posixpath.normpath(line[1:].strip() if include else line).lstrip("/")
            if pattern in ("", "."):
                continue
            rules.append(Rule(_translate(pattern), include))
        return cls(tuple(rules))

    @classmethod
    def of_context(cls, directory: Path) -> DockerIgnore:
        path = directory / FILE_NAME
        return cls.parse(path.read_text()) if path.is_file() else cls()

    @property
    def re_includes(self) -> bool:
        return any(rule.include for rule in self.rules)

    def excluded(self, relpath: str) -> bool:
        """Whether ``relpath`` (relative to the context, '/'-separated) is left out of it."""
        parts = relpath.split("/")
        prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
        verdict = False
        for rule in self.rules:
            if any(rule.regex.match(p) for p in prefixes):  # a matched directory covers what is under it
                verdict = not rule.include
        return verdict

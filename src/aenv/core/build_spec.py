"""What a template build asks for, as E2B's ``Template`` / ``AsyncTemplate`` send it, and what each step
is in a sandbox: the step list, the cache key of every step, and the shell a COPY runs.

Steps are E2B's: RUN (a command, optionally as a user), COPY (an uploaded tar of files under a source
pattern, to a destination, optionally owned by a user and with a mode), ENV (build-time variables: E2B
documents them as "available only during template build"; ``$NAME`` in a value is expanded in the
build sandbox, over the variables set so far), WORKDIR and USER (for the steps after them,
and the sandbox's defaults). Every step's cache key hashes the base and everything before it, so a
rebuild that changes only the last step finds the state before it and redoes that step alone.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from dataclasses import dataclass, field

from aenv.errors import InvalidRequest

STEP_TYPES = ("RUN", "COPY", "ENV", "WORKDIR", "USER")
FILES_HASH = re.compile(r"^[0-9a-f]{64}$")
_USER = re.compile(r"^[a-z_][a-z0-9_.-]{0,31}(:[a-z_][a-z0-9_.-]{0,31})?$|^[0-9]{1,10}(:[0-9]{1,10})?$")
_MODE = re.compile(r"^0?[0-7]{3,4}$")


@dataclass(frozen=True)
class Step:
    type: str
    args: tuple[str, ...] = ()
    files_hash: str | None = None
    force: bool = False

    @property
    def changes_files(self) -> bool:
        return self.type in ("RUN", "COPY")

    def describe(self) -> str:
        return f"{self.type} {' '.join(self.args)}".strip()


@dataclass(frozen=True)
class BuildSpec:
    from_image: str | None = None
    from_template: str | None = None
    steps: tuple[Step, ...] = ()
    start_cmd: str | None = None
    ready_cmd: str | None = None
    force: bool = False

    def __post_init__(self) -> None:
        if (self.from_image is None) == (self.from_template is None):
            raise InvalidRequest("a build needs exactly one of fromImage and fromTemplate")
        for i, step in enumerate(self.steps, 1):
            _check(i, step)


def _check(i: int, step: Step) -> None:
    where = f"step {i} ({step.type})"
    if step.type not in STEP_TYPES:
        raise InvalidRequest(f"{where}: unknown step type; aenv builds {', '.join(STEP_TYPES)}")
    a = step.args
    if step.type == "RUN" and not (1 <= len(a) <= 2 and a[0].strip()):
        raise InvalidRequest(f"{where}: args must be [command] or [command, user]")
    if step.type == "COPY":
        if len(a) < 2 or not a[0] or not a[1]:
            raise InvalidRequest(f"{where}: args must be [source, destination, user?, mode?]")
        if step.files_hash is None or not FILES_HASH.match(step.files_hash):
            raise InvalidRequest(f"{where}: filesHash must be the sha256 of the uploaded files")
        if len(a) > 2 and a[2] and not _USER.match(a[2]):
            raise InvalidRequest(f"{where}: bad owner {a[2]!r}")
        if len(a) > 3 and a[3] and not _MODE.match(a[3]):
            raise InvalidRequest(f"{where}: bad mode {a[3]!r}")
    if step.type == "ENV" and (len(a) % 2 or not a or not all(re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k) for k in a[::2])):
        raise InvalidRequest(f"{where}: args must be name, value pairs")
    if step.type in ("WORKDIR", "USER") and (len(a) != 1 or not a[0]):
        raise InvalidRequest(f"{where}: args must be one value")
    if step.type == "USER" and not _USER.match(a[0]):
        raise InvalidRequest(f"{where}: bad user {a[0]!r}")
    if step.type == "WORKDIR" and not a[0].startswith("/"):
        raise InvalidRequest(f"{where}: the working directory must be absolute")


@dataclass
class BuildState:
    """What the steps so far left for the next one (and, at the end, for the template): the
    variables (build-time only), the user steps run as (``root`` until a USER step), the user the
    template's sandboxes default to (set by USER steps; None: the base's) and the working directory."""

    env: dict[str, str] = field(default_factory=dict)
    user: str = "root"
    default_user: str | None = None
    workdir: str | None = None

    def to_json(self) -> dict[str, object]:
        return {"env": dict(self.env), "user": self.user, "default_user": self.default_user, "workdir": self.workdir}

    @classmethod
    def from_json(cls, raw: dict[str, object]) -> BuildState:
        env, default_user, workdir = raw.get("env"), raw.get("default_user"), raw.get("workdir")
        return cls(dict(env) if isinstance(env, dict) else {}, str(raw.get("user") or "root"),
                   default_user if isinstance(default_user, str) else None,
                   workdir if isinstance(workdir, str) else None)

    def after(self, step: Step) -> BuildState:
        """The state after a metadata step (ENV, WORKDIR, USER); file steps leave it as it is."""
        if step.type == "ENV":
            env = {**self.env, **dict(zip(step.args[::2], step.args[1::2], strict=True))}
            return BuildState(env, self.user, self.default_user, self.workdir)
        if step.type == "WORKDIR":
            return BuildState(dict(self.env), self.user, self.default_user, step.args[0])
        if step.type == "USER":
            return BuildState(dict(self.env), step.args[0], step.args[0], self.workdir)
        return self


_REFERENCE = re.compile(r"\$(?:([A-Za-z_][A-Za-z0-9_]*)|\{([A-Za-z_][A-Za-z0-9_]*)\})")


def env_references(step: Step) -> list[str]:
    """The variables an ENV step's values name (``$NAME`` / ``${NAME}``), in order, once each. The SDK
    sends them unexpanded (``ENV PATH=/opt/bin:$PATH`` arrives as written): the builder expands them
    in the sandbox, as E2B's does (``printf | envsubst``)."""
    names = [m[1] or m[2] for value in step.args[1::2] for m in _REFERENCE.finditer(value)]
    return list(dict.fromkeys(names))


def lookup_script(names: list[str]) -> str:
    """POSIX sh printing each variable's value (empty when unset) NUL-terminated; the names are
    identifiers (``env_references``), so they need no quoting."""
    return "printf '%s\\000' " + " ".join(f'"${{{n}-}}"' for n in names)


def expand_env(step: Step, values: dict[str, str]) -> Step:
    """The ENV step with ``$NAME`` / ``${NAME}`` replaced by ``values`` (unset: empty), envsubst's rule:
    other ``$`` forms (``$$``, ``${A:-x}``, ``$(...)``) stay as written."""
    args = [a if i % 2 == 0 else _REFERENCE.sub(lambda m: values.get(m[1] or m[2], ""), a)
            for i, a in enumerate(step.args)]  # fmt: skip
    return Step(step.type, tuple(args), step.files_hash, step.force)


def chain_keys(base_key: str, spec: BuildSpec) -> list[str]:
    """Cache key after each step (index 0: the base alone). ``spec.force`` does not enter the key:
    it only says not to use what is cached."""
    keys = [hashlib.sha256(base_key.encode()).hexdigest()]
    for step in spec.steps:
        body = json.dumps([step.type, list(step.args), step.files_hash], separators=(",", ":"))
        keys.append(hashlib.sha256((keys[-1] + body).encode()).hexdigest())
    return keys


def final_key(last: str, spec: BuildSpec) -> str:
    body = json.dumps(["final", spec.start_cmd, spec.ready_cmd], separators=(",", ":"))
    return hashlib.sha256((last + body).encode()).hexdigest()


def first_forced(spec: BuildSpec) -> int | None:
    """1-based index of the first step that must not come from the cache (E2B ``skip_cache`` marks it
    and every step after it ``force``), 0 for the whole build, None if nothing is forced."""
    if spec.force:
        return 0
    return next((i for i, s in enumerate(spec.steps, 1) if s.force), None)


def copy_script(step: Step, archive: str) -> str:
    """POSIX sh that unpacks ``archive`` (the uploaded tar, paths relative to the client's context) and
    copies what matches the source pattern to the destination, as Docker's COPY does: a directory's
    contents into the destination, one file to the destination path (or into it, if it ends in /)."""
    src, dest = step.args[0], step.args[1]
    owner = step.args[2] if len(step.args) > 2 else ""
    mode = step.args[3] if len(step.args) > 3 else ""
    unpack = f"{archive}.d"
    pattern = src if any(c in src for c in "*?[") else shlex.quote(src)
    lines = [
        "set -e",
        # a relative destination is the build's working directory's (the step runs in it), as
        # Docker's and E2B's: resolved before the script moves into the unpacked upload
        f"dest={shlex.quote(dest)}",
        'case "$dest" in /*) ;; *) dest="$PWD/$dest" ;; esac',
        f"rm -rf {unpack}; mkdir -p {unpack}",
        f"tar -xf {archive} -C {unpack}",
        f"cd {unpack}",
        f"set -- {pattern}",
        '[ -e "$1" ] || { echo "COPY: nothing matches the source" >&2; exit 2; }',
    ]
    # owner and mode on the unpacked copies, before cp -a carries them over: only what is copied
    # changes, never what the destination held before
    if owner:
        lines.append(f'chown -R {shlex.quote(owner)} "$@"')
    if mode:
        lines.append(f'chmod -R {mode} "$@"')
    lines += [
        'if [ $# -eq 1 ] && [ -d "$1" ]; then mkdir -p "$dest"; cp -a "$1/." "$dest/"',
        'elif [ $# -eq 1 ] && [ "${dest%/}" = "$dest" ]; then mkdir -p "$(dirname "$dest")"; cp -a "$1" "$dest"',
        'else mkdir -p "$dest"; cp -a "$@" "$dest/"; fi',
        f"cd /; rm -rf {unpack} {archive}",
    ]
    return "\n".join(lines)

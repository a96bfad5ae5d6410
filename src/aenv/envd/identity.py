"""Who envd acts as: sandbox identity, users, and path resolution (spec §3.1).

``SandboxState`` holds what ``POST /init`` sets (sandbox-wide env vars, access
token, default user and workdir, sandbox and template ids). ``User`` is read
from the sandbox's own ``/etc/passwd`` and ``/etc/group`` via ``pwd``/``grp``:
envd runs after pivot_root, so those modules see the sandbox's files.
"""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass, field

from aenv.envd.errors import InvalidArgument, Unauthenticated

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


_ACCOUNT_FILES = ("/etc/passwd", "/etc/group")
_USERS: dict[str, tuple[tuple[tuple[int, int, int, int], ...], User]] = {}


def _account_files_stamp() -> tuple[tuple[int, int, int, int], ...]:
    """What identifies the current contents of passwd and group: (device, inode, size, mtime) each
    (an edit in place changes mtime and usually size; ``useradd`` replaces the file: a new inode)."""
    out = []
    for path in _ACCOUNT_FILES:
        try:
            st = os.stat(path)
        except OSError:
            out.append((0, 0, -1, 0))
        else:
            out.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: str
    groups: tuple[int, ...] = ()

    @classmethod
    def lookup(cls, name: str) -> User:
        """Find ``name`` in the sandbox's passwd; raises ``KeyError`` if absent.

        Every process start and file call names a user; the answer is kept while ``/etc/passwd``
        and ``/etc/group`` are unchanged (two stats instead of reading both files each time), so a
        ``useradd`` in the sandbox is seen at once."""
        stamp = _account_files_stamp()
        cached = _USERS.get(name)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        entry = pwd.getpwnam(name)
        try:
            groups = tuple(os.getgrouplist(name, entry.pw_gid))
        except OSError:
            groups = (entry.pw_gid,)
        user = cls(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir or "/", groups)
        if len(_USERS) >= 64:
            _USERS.clear()
        _USERS[name] = (stamp, user)
        return user

    @classmethod
    def root(cls) -> User:
        try:
            return cls.lookup("root")
        except KeyError:
            return cls("root", 0, 0, "/root", (0,))

    def owns_files(self) -> bool:
        """True when files we create must be chowned to this user (we are root, they are not)."""
        return os.geteuid() == 0 and self.uid != 0


@dataclass
class SandboxState:
    """Mutable sandbox identity, replaced field by field by ``POST /init``."""

    env_vars: dict[str, str] = field(default_factory=dict)
    access_token: str | None = None
    default_user: str = "user"
    default_workdir: str | None = None
    sandbox_id: str = ""
    template_id: str = ""

    def resolve_user(self, name: str | None) -> User:
        """The explicit user ``name`` (unknown ⇒ ``Unauthenticated``) or the default user.

        A missing default user falls back to root, so bare images without a
        ``user`` account still work.
        """
        if name:
            try:
                return User.lookup(name)
            except KeyError:
                raise Unauthenticated(f"invalid username: '{name}'") from None
        try:
            return User.lookup(self.default_user)
        except KeyError:
            return User.root()

    def sandbox_env(self) -> dict[str, str]:
        env = {"E2B_SANDBOX": "true", "E2B_SANDBOX_ID": self.sandbox_id, "E2B_TEMPLATE_ID": self.template_id}
        env.update(self.env_vars)
        return env

    def process_env(self, user: User, extra: dict[str, str]) -> dict[str, str]:
        """Environment in override order: daemon env and user basics, sandbox-wide vars, per-request vars.

        The daemon's own environment is the base layer because the agent starts envd
        with the image's ``ENV`` (PATH, JAVA_HOME, LANG, ...), which commands should
        see as they would under ``docker run``.
        """
        env = dict(os.environ)
        env.update(
            {
                "PATH": os.environ.get("PATH") or DEFAULT_PATH,
                "HOME": user.home,
                "USER": user.name,
                "LOGNAME": user.name,
            }
        )
        env.update(self.sandbox_env())
        env.update(extra)
        return env

    def resolve_path(self, path: str, user: User) -> str:
        return resolve_path(path, user.home, self.default_workdir)


def resolve_path(path: str, home: str, workdir: str | None = None) -> str:
    """Resolve an SDK path to an absolute, cleaned path inside the sandbox.

    Empty ⇒ the default workdir (else home); ``~``/``~/x`` ⇒ home; relative ⇒
    joined to home. ``..`` is resolved lexically, which can only land somewhere
    else inside the sandbox root: there is nothing above it after pivot_root.
    """
    if path == "":
        path = workdir or home
    elif path.startswith("~"):
        if path == "~" or path.startswith("~/"):
            path = home + path[1:]
        else:
            raise InvalidArgument(f"path '{path}': '~user' expansion is not supported")
    if "\x00" in path:
        raise InvalidArgument("path contains a NUL byte")
    if not path.startswith("/"):
        path = os.path.join(home, path)
    cleaned = os.path.normpath(path)
    if cleaned.startswith("//"):
        cleaned = "/" + cleaned.lstrip("/")
    return cleaned


# ---- host facts after a restore (VM runtime) ------------------------------------------------------
# A restored or forked guest wakes up with the clock and the kernel CRNG state of the moment its
# snapshot was taken: every fork of one snapshot would hand out the same "random" bytes. The host
# sends its wall time and fresh random bytes in ``POST /init``; these apply them.

RNDADDENTROPY = 0x40085203  # _IOW('R', 0x03, int[2]): credit entropy and mix the bytes in
RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07): reseed the CRNG from the input pool now (Linux >= 4.17)
MAX_SEED_BYTES = 512


def set_wall_clock(unix_seconds: float) -> None:
    """``clock_settime(CLOCK_REALTIME)``; needs CAP_SYS_TIME (root in a VM guest). Raises OSError."""
    import time

    time.clock_settime(time.CLOCK_REALTIME, unix_seconds)


def reseed_rng(seed: bytes, device: str = "/dev/urandom") -> list[str]:
    """Mix ``seed`` into the kernel's input pool and force a CRNG reseed, so that getrandom()
    output diverges from any other copy of this memory image. Returns what was done: "write"
    always (any user may write to /dev/urandom; it mixes but credits nothing), "addentropy" and
    "reseed" when the ioctls are allowed (CAP_SYS_ADMIN). Raises OSError only if the write fails."""
    import fcntl
    import struct

    done: list[str] = []
    fd = os.open(device, os.O_WRONLY)
    try:
        os.write(fd, seed)
        done.append("write")
        try:
            fcntl.ioctl(fd, RNDADDENTROPY, struct.pack("ii", len(seed) * 8, len(seed)) + seed)
            done.append("addentropy")
        except OSError:
            pass
        try:
            fcntl.ioctl(fd, RNDRESEEDCRNG)
            done.append("reseed")
        except OSError:
            pass
    finally:
        os.close(fd)
    return done

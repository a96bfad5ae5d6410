"""The user namespace ns sandboxes run in (``ns_userns_uid``): uids 0-65535 inside, host uids from the base.

One namespace per uid range in use (``aenv/uid_ranges.py``: slot 0 for a server with fewer than two
teams, one range per team otherwise; ``NsHost.userns_at``), made on first use, held as an fd the
launcher inherits (``agent/launch.run_in_userns`` joins it, then creates the sandbox's other
namespaces in it). Shared by a team's sandboxes, not one per sandbox: see ``docs/ARCHITECTURE.md``
("ns user namespace"). Nothing is
mounted on the host for it: the fd keeps it alive, and so does every process in it, so sandboxes
adopted after a restart keep theirs while new ones get a new namespace with the same mapping.

Made with util-linux ``unshare --user`` holding a pipe open (no fork in this threaded process); the
server, host root, writes the maps (``newuidmap`` would want /etc/subuid entries) and opens the
namespace before letting the helper exit.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from aenv.agent import idmap
from aenv.config import Settings
from aenv.uid_ranges import RANGE, TOP

__all__ = ["RANGE", "SharedUserns", "UsernsError", "layer_dirs", "mapped_base"]


def layer_dirs(settings: Settings) -> tuple[Path, ...]:
    """Where an overlay lower or upper of an ns sandbox can live: what ``unusable_on`` must try."""
    return (settings.cache_dir, settings.templates_dir, settings.snapshots_dir, settings.sandboxes_dir)


class UsernsError(RuntimeError):
    pass


class SharedUserns:
    """The fd of one user namespace mapping 0..RANGE-1 to ``host_uid``.. (uids and gids alike)."""

    def __init__(self, host_uid: int) -> None:
        if host_uid <= 0 or host_uid + RANGE > TOP:
            raise ValueError(f"a user namespace's first host uid must be in 1..{TOP - RANGE}, not {host_uid}")
        self.host_uid = host_uid
        self._fd: int | None = None
        self._lock = threading.Lock()

    def fd(self) -> int:
        """The namespace's fd (made on first use; blocking: call from a thread)."""
        with self._lock:
            if self._fd is None:
                self._fd = _make(self.host_uid)
            return self._fd

    def unusable_on(self, dirs: Iterable[Path]) -> str | None:
        """Why sandboxes cannot run in this namespace here, or None: the namespace must be made, and
        every filesystem an overlay layer or upper can live on must take an idmapped mount (overlayfs,
        NFS and most FUSE filesystems do not; a launch there would fail). Nothing is mounted: the
        idmapped copy is made detached and dropped. Blocking."""
        try:
            fd = self.fd()
        except UsernsError as exc:
            return str(exc)
        for path in dirs:
            while not path.exists():  # the nearest existing directory: the filesystem it will be made on
                path = path.parent
            try:
                os.close(idmap.idmapped_clone(str(path), fd))
            except OSError as exc:
                return f"{path} cannot be mounted idmapped ({exc.strerror or exc})"
        return None

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _make(host_uid: int, timeout: float = 10.0) -> int:
    mine = os.stat("/proc/self/ns/user").st_ino
    helper = subprocess.Popen(["unshare", "--user", "--", "cat"], stdin=subprocess.PIPE,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        path = f"/proc/{helper.pid}/ns/user"
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while True:  # unshare(2) has run once the helper's namespace is not ours
            try:
                if os.stat(path).st_ino != mine:
                    break
            except FileNotFoundError:
                pass
            if helper.poll() is not None or time.monotonic() > deadline:
                err = helper.stderr.read().decode(errors="replace").strip() if helper.stderr else ""
                raise UsernsError(f"cannot make the sandboxes' user namespace: {err or 'unshare --user failed'}")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{helper.pid}/{name}", "w") as fh:
                fh.write(f"0 {host_uid} {RANGE}\n")
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    finally:
        assert helper.stdin is not None
        helper.stdin.close()
        helper.wait()
        if helper.stderr is not None:
            helper.stderr.close()


def mapped_base(pid: int) -> int | None:
    """The host uid that uid 0 of ``pid``'s user namespace is, or None for the host's own namespace
    (its map is the identity over every uid)."""
    first = Path(f"/proc/{pid}/uid_map").read_text().split()
    inside, outside, count = (int(v) for v in first[:3])
    if inside == 0 and outside == 0 and count == 2**32 - 1:
        return None
    return outside - inside

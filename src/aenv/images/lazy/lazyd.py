"""The server's handle on the node's ``aenv-lazyd``: start or adopt it, register images, read stats.

The daemon is a separate process in its own session so that it outlives a server restart (sandboxes
do too, and their lower filesystems live on its mount). ``ensure()`` adopts a live daemon (pid file
plus a mount that answers) or starts a new one, which first detaches a dead daemon's mount.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aenv
from aenv.images.lazy.format import LazyIndex

PIN_XATTR = "user.aenv.pin"
STATS_XATTR = "user.aenv.stats"


class LazyUnavailable(RuntimeError):
    """This node cannot serve lazy images (no /dev/fuse, no libfuse, not root); the full pull is used."""


def fuse_support() -> str | None:
    """None when lazy images can work here, else the reason they cannot."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    if os.geteuid() != 0:
        return "the FUSE mount needs root"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"mfusepy/libfuse3 unavailable: {exc}"
    return None


@dataclass
class LazyDaemon:
    root: Path
    budget: int
    mirrors: dict[str, str] | None = None
    insecure: tuple[str, ...] = ()
    parallel: int = 8

    @property
    def mnt(self) -> Path:
        return self.root / "mnt"

    def path_of(self, name: str) -> Path:
        return self.mnt / f"{name}.img"

    def pid(self) -> int | None:
        try:
            pid = int((self.root / "daemon.pid").read_text())
            os.kill(pid, 0)
        except (OSError, ValueError):
            return None
        return pid

    def alive(self) -> bool:
        if self.pid() is None:
            return False
        try:
            os.listdir(self.mnt)
        except OSError:
            return False
        return os.path.ismount(self.mnt)

    def ensure(self, timeout: float = 15.0) -> None:
        if self.alive():
            return
        reason = fuse_support()
        if reason:
            raise LazyUnavailable(reason)
        self.root.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": str(Path(aenv.__file__).resolve().parents[1])}
        cmd = [
            sys.executable,
            "-m",
            "aenv.images.lazy.daemon",
            "--root",
            str(self.root),
            "--budget",
            str(self.budget),
            "--mirrors",
            json.dumps(self.mirrors or {}),
            "--insecure",
            ",".join(self.insecure),
            "--parallel",
            str(self.parallel),
        ]
        old = getattr(self, "_proc", None)
        if old is not None:  # our earlier daemon died: reap it
            old.wait()
        (self.root / "daemon.pid").unlink(missing_ok=True)
        with open(self.root / "daemon.log", "ab") as logf:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while not self.alive():
            if proc.poll() is not None:
                raise LazyUnavailable(f"aenv-lazyd exited ({proc.returncode}): {self.log_tail()}")
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise LazyUnavailable(f"aenv-lazyd did not mount within {timeout} s: {self.log_tail()}")
            time.sleep(0.02)
        self._proc = proc  # reaped by stop(); a server that exits leaves it to init

    def log_tail(self, n: int = 2000) -> str:
        try:
            return (self.root / "daemon.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def register(self, name: str, index: LazyIndex, source: dict[str, Any]) -> Path:
        """Make ``<mnt>/<name>.img`` exist (atomic write of its registration); returns its path."""
        d = self.root / "images"
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{name}.{os.getpid()}"
        tmp.write_text(json.dumps({"index": index.to_json(), "source": source}))
        os.replace(tmp, d / f"{name}.json")
        return self.path_of(name)

    def registered(self) -> list[str]:
        return sorted(p.stem for p in (self.root / "images").glob("*.json"))

    def stats(self, name: str) -> dict[str, Any]:
        return dict(json.loads(os.getxattr(self.path_of(name), STATS_XATTR)))

    def pin(self, name: str, pinned: bool = True) -> None:
        """Pin: fetch every chunk and keep them out of eviction (blocks until local). OSError(EIO) if not."""
        os.setxattr(self.path_of(name), PIN_XATTR, b"1" if pinned else b"0")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (the daemon detaches its mount), wait, SIGKILL, detach. Idempotent."""
        pid = self.pid()
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and _running(pid):
                time.sleep(0.02)
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        proc = getattr(self, "_proc", None)
        if proc is not None:
            proc.wait()
        if shutil.which("umount"):
            subprocess.run(["umount", "-l", str(self.mnt)], capture_output=True, check=False)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM
    try:  # a zombie child of ours counts as ended
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False

"""Child processes of the agent: reap everything, keep envd alive.

Why not asyncio's subprocess support: as PID 1 we must reap *every* orphan that gets re-parented to
us, which means ``waitpid(-1)``. asyncio's child watchers wait for specific pids and would race with
that loop, so children are spawned with ``os.posix_spawn`` and all reaping happens here, driven by
SIGCHLD.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable, Sequence

log = logging.getLogger("aenv.agent")

_RESTART_MIN = 0.05
_RESTART_MAX = 2.0
_HEALTHY_AFTER = 10.0  # a child that lived this long resets the back-off


def spawn(argv: Sequence[str], env: dict[str, str], *, stdout: str = "/dev/null") -> int:
    """Start ``argv`` in its own session with stdin from /dev/null and output to ``stdout``.
    No fd of ours leaks: Python fds are close-on-exec by default and stdio is replaced."""
    actions = [
        (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, stdout, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600),
        (os.POSIX_SPAWN_DUP2, 1, 2),
    ]
    return os.posix_spawn(argv[0], list(argv), env, file_actions=actions, setsid=True)


class Supervised:
    """One long-running child that is restarted (with back-off) whenever it exits."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str], stdout: str = "/dev/null") -> None:
        self.name = name
        self.argv = list(argv)
        self.env = env
        self.stdout = stdout
        self.pid: int | None = None
        self.restarts = 0
        self._started_at = 0.0
        self._backoff = _RESTART_MIN
        self._stopping = False

    def start(self) -> None:
        try:
            self.pid = spawn(self.argv, self.env, stdout=self.stdout)
        except OSError as exc:
            log.error("%s: spawn failed: %s", self.name, exc)
            self.pid = None
            return
        self._started_at = time.monotonic()
        log.info("%s started pid=%d", self.name, self.pid)

    def on_exit(self, loop: asyncio.AbstractEventLoop, status: int) -> None:
        log.warning("%s pid=%s exited status=%d", self.name, self.pid, status)
        self.pid = None
        if self._stopping:
            return
        if time.monotonic() - self._started_at > _HEALTHY_AFTER:
            self._backoff = _RESTART_MIN
        delay, self._backoff = self._backoff, min(self._backoff * 2, _RESTART_MAX)
        self.restarts += 1
        loop.call_later(delay, self.start)

    def stop(self) -> None:
        self._stopping = True
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Reaper:
    """SIGCHLD handler: reap all exited children; tell the supervised ones."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._watched: dict[int, Callable[[int], None]] = {}
        self.children: list[Supervised] = []

    def install(self) -> None:
        self._loop.add_signal_handler(signal.SIGCHLD, self.reap)

    def supervise(self, child: Supervised, running_pid: int | None = None) -> None:
        """Watch ``child``; start it unless it already runs as ``running_pid`` (forked before the loop)."""
        self.children.append(child)
        if running_pid is None:
            child.start()
        else:
            child.pid = running_pid
            child._started_at = time.monotonic()
        self.reap()  # it may already have exited before the SIGCHLD handler existed

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            except InterruptedError:
                continue
            if pid == 0:
                return
            for child in self.children:
                if child.pid == pid:
                    child.on_exit(self._loop, status)
                    break

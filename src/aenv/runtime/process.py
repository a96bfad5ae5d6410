"""Host processes the ns runtime owns: the sandbox's namespace init (via ``unshare``) and helpers
such as slirp4netns.

* ``Reaped`` - a child of the server, reaped as soon as it exits through a pidfd on the event loop
  (no thread per child, no global SIGCHLD handler that could steal other code's children).
* ``ProcRef`` - a pid *plus its start time*, so a recycled pid is never mistaken for our process,
  e.g. after a server restart when only the numbers in the state file are left.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass


def proc_start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (clock ticks since boot), None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    try:
        rest = stat.rsplit(")", 1)[1].split()
        if rest[0] == "Z":
            return None  # a zombie is as good as gone
        return int(rest[19])
    except (IndexError, ValueError):
        return None


def _resolve(fut: asyncio.Future[object]) -> None:
    if not fut.done():
        fut.set_result(None)


@dataclass(frozen=True)
class ProcRef:
    pid: int
    start: int

    def alive(self) -> bool:
        return proc_start_time(self.pid) == self.start

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal it only if it is still the same process (pidfd makes the check race-free)."""
        try:
            fd = os.pidfd_open(self.pid)
        except (ProcessLookupError, OSError):
            return
        try:
            if proc_start_time(self.pid) == self.start:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(fd, sig)
        finally:
            os.close(fd)

    def wait_gone(self, timeout: float) -> bool:
        """Block until the process has exited (works for non-children via pidfd poll)."""
        try:
            fd = os.pidfd_open(self.pid)
        except (ProcessLookupError, OSError):
            return True
        try:
            if proc_start_time(self.pid) != self.start:
                return True
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return not self.alive()
                if poller.poll(left * 1000):
                    return True
        finally:
            os.close(fd)

    async def wait_gone_async(self, timeout: float) -> bool:
        """``wait_gone`` on the event loop (pidfd readability), without tying up a worker thread."""
        try:
            fd = os.pidfd_open(self.pid)
        except (ProcessLookupError, OSError):
            return True
        loop = asyncio.get_running_loop()
        gone: asyncio.Future[object] = loop.create_future()
        try:
            if proc_start_time(self.pid) != self.start:
                return True
            loop.add_reader(fd, _resolve, gone)
            try:
                async with asyncio.timeout(timeout):
                    await gone
                return True
            except TimeoutError:
                return not self.alive()
            finally:
                loop.remove_reader(fd)
        finally:
            os.close(fd)

    @classmethod
    def of(cls, pid: int) -> ProcRef | None:
        start = proc_start_time(pid)
        return None if start is None else cls(pid, start)


def _popen(argv: Sequence[str], kw: dict[str, object]) -> subprocess.Popen[bytes]:
    """A child of the server in a session of its own, no fd of the server's but those passed."""
    return subprocess.Popen(list(argv), close_fds=True, start_new_session=True, **kw)  # type: ignore[call-overload,no-any-return]


def _kill_spawned(done: asyncio.Future[subprocess.Popen[bytes]]) -> None:
    if done.cancelled() or done.exception() is not None:
        return
    proc = done.result()
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    threading.Thread(target=proc.wait, name="aenv-reap-abandoned", daemon=True).start()


class Reaped:
    """A child process of the server that is waited for the moment it exits."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.exited = asyncio.get_running_loop().create_future()
        self._loop = asyncio.get_running_loop()
        self._pidfd: int | None = os.pidfd_open(proc.pid)
        self._loop.add_reader(self._pidfd, self._on_exit)

    @classmethod
    def spawn(cls, argv: Sequence[str], **kw: object) -> Reaped:
        return cls(_popen(argv, kw))

    @classmethod
    async def spawn_off_loop(cls, argv: Sequence[str], **kw: object) -> Reaped:
        """:meth:`spawn` with the fork and exec in a thread: they hold the calling thread ~1-2 ms
        (measured on the server's loop during a burst of restores, each spawning slirp4netns), which
        every other request on the loop waited out."""
        spawning = asyncio.ensure_future(asyncio.to_thread(_popen, argv, kw))
        try:
            proc: subprocess.Popen[bytes] = await asyncio.shield(spawning)
        except asyncio.CancelledError:  # the thread goes on: what it starts is killed, never left running
            spawning.add_done_callback(_kill_spawned)
            raise
        return cls(proc)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _on_exit(self) -> None:
        code = self.proc.poll()
        if code is None:
            return
        self._close_fd()
        if not self.exited.done():
            self.exited.set_result(code)

    def _close_fd(self) -> None:
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    async def readline(self, limit: int = 65536) -> bytes:
        """One line from the child's stdout pipe, read on the event loop (no worker thread)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        os.set_blocking(fd, False)
        loop = asyncio.get_running_loop()
        buf = b""
        while b"\n" not in buf and len(buf) < limit:
            ready: asyncio.Future[object] = loop.create_future()
            loop.add_reader(fd, _resolve, ready)
            try:
                await ready
            finally:
                loop.remove_reader(fd)
            try:
                chunk = os.read(fd, 4096)
            except BlockingIOError:
                continue
            if not chunk:
                break
            buf += chunk
        return buf.split(b"\n", 1)[0] + (b"\n" if b"\n" in buf else b"")

    async def aclose(self, timeout: float = 5.0) -> None:
        """SIGKILL and reap; safe to call twice and when cancelled (the reap is shielded)."""
        self.kill()
        if not self.exited.done():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await asyncio.shield(self.exited)
        if self.proc.returncode is None:
            self.proc.poll()
        self._close_fd()
        for stream in (self.proc.stdout, self.proc.stderr, self.proc.stdin):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()

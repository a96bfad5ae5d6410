"""The process table: spawned processes, their output fan-out and their exits.

Each ``ManagedProcess`` owns its pipes or PTY master, read from the event loop
with ``add_reader`` and reaped through a pidfd, so no thread sits on a process.
Output goes only to current subscribers (each a queue); with none it is dropped.
Streams subscribe and unsubscribe; nothing a stream does kills the process.
Exits are retained for a while so ``Connect`` to a just-finished pid still gets
its end event.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import fcntl
import logging
import os
import signal
import struct
import subprocess
import sys
import termios
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aenv.envd import mergeable
from aenv.envd.errors import Internal, InvalidArgument, NotFound
from aenv.envd.fields import Message
from aenv.envd.identity import User

log = logging.getLogger("aenv.envd.process")

PIPE_CHUNK = 32 * 1024
PTY_CHUNK = 16 * 1024
SUBSCRIBER_HIGH_WATER = 64  # queued chunks per subscriber before reading pauses
DRAIN_AFTER_EXIT_S = 2.0  # grandchildren may hold the pipes open; stop waiting for EOF after this
RETAINED_EXITS = 256
RETAIN_EXIT_S = 600.0

_SIGNAL_NAMES = {
    signal.SIGHUP: "hangup",
    signal.SIGINT: "interrupt",
    signal.SIGQUIT: "quit",
    signal.SIGILL: "illegal instruction",
    signal.SIGTRAP: "trace/breakpoint trap",
    signal.SIGABRT: "aborted",
    signal.SIGBUS: "bus error",
    signal.SIGFPE: "floating point exception",
    signal.SIGKILL: "killed",
    signal.SIGUSR1: "user defined signal 1",
    signal.SIGSEGV: "segmentation fault",
    signal.SIGUSR2: "user defined signal 2",
    signal.SIGPIPE: "broken pipe",
    signal.SIGALRM: "alarm clock",
    signal.SIGTERM: "terminated",
}


def end_event(returncode: int) -> Message:
    """EndEvent JSON in Go ``ProcessState`` terms: -1 and "signal: …" when signalled."""
    if returncode < 0:
        signum = -returncode
        try:
            name = _SIGNAL_NAMES.get(signal.Signals(signum), "") or signal.strsignal(signum) or ""
        except ValueError:
            name = ""
        status = f"signal: {name.lower() or signum}"
        return {"exitCode": -1, "exited": False, "status": status, "error": status}
    status = f"exit status {returncode}"
    event: Message = {"exitCode": returncode, "exited": True, "status": status}
    if returncode != 0:
        event["error"] = status
    return event


@dataclass
class ProcessConfig:
    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str | None

    def to_json(self) -> Message:
        out: Message = {"cmd": self.cmd, "args": self.args, "envs": self.envs}
        if self.cwd is not None:
            out["cwd"] = self.cwd
        return out


@dataclass
class SpawnRequest:
    config: ProcessConfig
    user: User
    env: dict[str, str]
    cwd: str
    tag: str | None = None
    pty_size: tuple[int, int] | None = None  # (cols, rows)
    stdin: bool = True


Subscriber = asyncio.Queue[Message | None]  # None marks the end of the process


@dataclass(eq=False)
class ManagedProcess:
    popen: subprocess.Popen[bytes]
    config: ProcessConfig
    tag: str | None
    pty_fd: int | None
    stdin_fd: int | None
    out_fds: dict[int, str]  # fd → "stdout" / "stderr" / "pty"
    subscribers: set[Subscriber] = field(default_factory=set)
    end: Message | None = None
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    reaped: asyncio.Event = field(default_factory=asyncio.Event)  # its pid is gone (exited: its output too)
    stdin_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    outputs_closed: asyncio.Event = field(default_factory=asyncio.Event)
    _open_fds: set[int] = field(default_factory=set)
    _paused: bool = False
    _kill_timer: asyncio.TimerHandle | None = None
    _write_waiter: asyncio.Future[None] | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def info(self) -> Message:
        out: Message = {"config": self.config.to_json(), "pid": self.pid}
        if self.tag is not None:
            out["tag"] = self.tag
        return out

    # ---- output fan-out

    def subscribe(self) -> Subscriber:
        queue: Subscriber = asyncio.Queue()
        if self.end is not None:
            queue.put_nowait(None)
        else:
            self.subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: Subscriber) -> None:
        self.subscribers.discard(queue)
        self.maybe_resume()

    def _publish(self, event: Message | None) -> None:
        for queue in self.subscribers:
            queue.put_nowait(event)

    def maybe_resume(self) -> None:
        """Restart reading once every subscriber has drained below the high-water mark."""
        if self._paused and all(q.qsize() < SUBSCRIBER_HIGH_WATER // 2 for q in self.subscribers):
            self._paused = False
            loop = asyncio.get_running_loop()
            for fd in self._open_fds:
                loop.add_reader(fd, self._on_readable, fd)

    def _on_readable(self, fd: int) -> None:
        kind = self.out_fds[fd]
        try:
            data = os.read(fd, PTY_CHUNK if kind == "pty" else PIPE_CHUNK)
        except BlockingIOError:
            return
        except OSError as exc:
            if exc.errno != errno.EIO:  # EIO: PTY slave closed
                log.warning("read from pid %s %s failed: %s", self.pid, kind, exc)
            data = b""
        if not data:
            self._close_output(fd)
            return
        if self.subscribers:
            self._publish({"data": {kind: _b64(data)}})
            if any(q.qsize() >= SUBSCRIBER_HIGH_WATER for q in self.subscribers):
                self._paused = True
                loop = asyncio.get_running_loop()
                for open_fd in self._open_fds:
                    loop.remove_reader(open_fd)

    def _close_output(self, fd: int) -> None:
        if fd in self._open_fds:
            asyncio.get_running_loop().remove_reader(fd)
            self._open_fds.discard(fd)
            if fd != self.pty_fd:
                os.close(fd)
            if not self._open_fds:
                self.outputs_closed.set()

    # ---- input

    @property
    def is_pty(self) -> bool:
        return "pty" in self.out_fds.values()

    async def write_input(self, data: bytes, pty: bool) -> None:
        """Write to the PTY master or the stdin pipe; fds are only used under ``stdin_lock``.

        The reaper closes them under the same lock, so a late writer can never hit a
        reused fd number.
        """
        if pty and not self.is_pty:
            raise Internal("process has no pty; send stdin instead")
        if not pty and self.is_pty:
            raise Internal("process runs in a pty; send pty input instead")
        async with self.stdin_lock:
            fd = self.pty_fd if pty else self.stdin_fd
            if fd is None:
                what = (
                    "process has exited" if self.end is not None else "stdin is not enabled or already closed"
                )
                raise Internal(f"cannot write input: {what}")
            await self._write_all(fd, data)

    async def _write_all(self, fd: int, data: bytes) -> None:
        """Write all of ``data`` to a non-blocking fd, waiting for writability on the loop.

        The wait is parked in ``_write_waiter`` so the reaper can abort it: a grandchild
        may keep a full stdin pipe open without ever reading it.
        """
        loop = asyncio.get_running_loop()
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                self._write_waiter = loop.create_future()
                loop.add_writer(fd, _resolve, self._write_waiter)
                try:
                    await self._write_waiter
                finally:
                    loop.remove_writer(fd)
                    self._write_waiter = None
            except OSError as exc:
                raise Internal(f"writing input failed: {exc.strerror}") from exc

    def _abort_write(self) -> None:
        if self._write_waiter is not None and not self._write_waiter.done():
            self._write_waiter.set_exception(Internal("cannot write input: process has exited"))

    async def close_stdin(self) -> None:
        if self.is_pty:
            raise Internal("cannot close stdin of a pty process; send Ctrl+D (0x04) instead")
        async with self.stdin_lock:
            if self.stdin_fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self.stdin_fd)
                self.stdin_fd = None

    def resize(self, cols: int, rows: int) -> None:
        if not self.is_pty:
            raise Internal("process has no pty to resize")
        if self.pty_fd is not None:
            _set_winsize(self.pty_fd, cols, rows)

    def signal(self, signum: int) -> None:
        if self.end is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill_at(self, deadline: float) -> None:
        """SIGKILL the process at loop time ``deadline`` (Connect-Timeout-Ms of Start)."""
        loop = asyncio.get_running_loop()
        self._kill_timer = loop.call_at(deadline, self.signal, signal.SIGKILL)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _wait_exit(popen: subprocess.Popen[bytes]) -> None:
    """Wait until ``popen`` has exited, without reaping it: pidfd readiness, or polling on old kernels."""
    loop = asyncio.get_running_loop()
    try:
        pidfd = os.pidfd_open(popen.pid)
    except OSError:  # kernel < 5.3
        while popen.poll() is None:
            await asyncio.sleep(0.05)
        return
    try:
        exited: asyncio.Future[None] = loop.create_future()
        loop.add_reader(pidfd, _resolve, exited)
        try:
            await exited
        finally:
            loop.remove_reader(pidfd)
    finally:
        os.close(pidfd)


def _set_winsize(fd: int, cols: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def shell_for(cmd: str, exists: Callable[[str], bool] = os.path.exists) -> str:
    """The SDK always asks for ``/bin/bash``; busybox/alpine images only have ``/bin/sh``."""
    if cmd == "/bin/bash" and not exists(cmd):
        return "/bin/sh"
    return cmd


def runas_helper() -> str | None:
    """The bundle's static ``runas`` (see aenv.runtime.tools), if present next to our interpreter."""
    path = os.path.join(sys.prefix, "bin", "runas")
    return path if os.access(path, os.X_OK) else None


def _pty_child_setup() -> None:
    """In the child, after setsid: make the PTY slave on fd 0 the controlling terminal."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class ProcessTable:
    """Running processes by pid, plus retained exits of recently finished ones."""

    def __init__(self) -> None:
        self._procs: dict[int, ManagedProcess] = {}
        self._exits: OrderedDict[int, tuple[float, Message, str | None]] = OrderedDict()
        self._reapers: set[asyncio.Task[None]] = set()

    def list(self) -> list[ManagedProcess]:
        return list(self._procs.values())

    def get(self, pid: int) -> ManagedProcess:
        proc = self._procs.get(pid)
        if proc is None:
            raise NotFound(f"process with pid {pid} not found")
        return proc

    def get_by_tag(self, tag: str) -> ManagedProcess:
        for proc in self._procs.values():
            if proc.tag == tag:
                return proc
        raise NotFound(f"process with tag {tag!r} not found")

    def retained_exit(self, pid: int | None = None, tag: str | None = None) -> Message | None:
        self._expire_exits()
        for key, (_, event, ptag) in reversed(self._exits.items()):
            if (pid is not None and key == pid) or (tag is not None and ptag == tag):
                return event
        return None

    def _expire_exits(self) -> None:
        cutoff = time.monotonic() - RETAIN_EXIT_S
        while self._exits and (
            len(self._exits) > RETAINED_EXITS or next(iter(self._exits.values()))[0] < cutoff
        ):
            self._exits.popitem(last=False)

    def spawn(self, req: SpawnRequest) -> ManagedProcess:
        """Start a process and register it; output subscribers may be added right after."""
        if not os.path.isdir(req.cwd):
            raise InvalidArgument(f"cwd '{req.cwd}' does not exist")
        cmd = shell_for(req.config.cmd)
        kwargs: dict[str, Any] = {
            "cwd": req.cwd,
            "env": req.env,
            "close_fds": True,
            "start_new_session": True,
        }
        argv = [cmd, *req.config.args]
        executable = cmd
        # KSM: envd marks itself only once idle (mergeable.py); what a client starts is mergeable from its
        # start (a prepared process a fork's children share with their parent), through runas --merge
        merge = mergeable.wanted() and not mergeable.marked() and req.pty_size is None
        other_user = req.user.uid != os.geteuid() or req.user.gid != os.getegid()
        if os.geteuid() == 0 and (other_user or merge):
            # Looked up per spawn: a zygote-born envd imported this module before pivot_root moved us.
            helper = runas_helper() if req.pty_size is None else None
            if helper is not None:
                # vfork + exec(runas) + exec(cmd) is much cheaper than CPython's fork-and-setuid path.
                if not os.access(cmd, os.X_OK):
                    raise InvalidArgument(f"failed to start process '{cmd}': not an executable file")
                groups = ",".join(str(g) for g in req.user.groups) or "-"
                argv = [helper, *(["--merge"] if merge else []), str(req.user.uid), str(req.user.gid), groups,
                        cmd, *req.config.args]  # fmt: skip
                executable = helper
            elif other_user:
                kwargs.update(user=req.user.uid, group=req.user.gid, extra_groups=list(req.user.groups))
        elif os.geteuid() != 0 and req.user.uid != os.geteuid():
            raise Internal(f"envd is not root and cannot run processes as '{req.user.name}'")

        parent_fds: list[int] = []
        child_fds: list[int] = []
        try:
            if req.pty_size is not None:
                master, slave = os.openpty()
                parent_fds.append(master)
                child_fds.append(slave)
                _set_winsize(master, *req.pty_size)
                popen = subprocess.Popen(
                    [cmd, *req.config.args],
                    executable=cmd,
                    stdin=slave,
                    stdout=slave,
                    stderr=slave,
                    # Only a C-level ioctl runs in the child, so the threads caveat does not bite.
                    preexec_fn=_pty_child_setup,  # noqa: PLW1509
                    **kwargs,
                )
                out_fds = {master: "pty"}
                pty_fd, stdin_fd = master, None
            else:
                stdin_fd = None
                stdin_arg: int = subprocess.DEVNULL
                if req.stdin:
                    r, w = os.pipe()
                    child_fds.append(r)
                    parent_fds.append(w)
                    stdin_arg, stdin_fd = r, w
                out_r, out_w = os.pipe()
                err_r, err_w = os.pipe()
                parent_fds += [out_r, err_r]
                child_fds += [out_w, err_w]
                popen = subprocess.Popen(
                    argv,
                    executable=executable,
                    stdin=stdin_arg,
                    stdout=out_w,
                    stderr=err_w,
                    **kwargs,
                )
                out_fds = {out_r: "stdout", err_r: "stderr"}
                pty_fd = None
        except OSError as exc:
            for fd in parent_fds:
                os.close(fd)
            raise InvalidArgument(f"failed to start process '{cmd}': {exc.strerror or exc}") from exc
        finally:
            for fd in child_fds:
                os.close(fd)

        for fd in parent_fds:
            os.set_blocking(fd, False)
        proc = ManagedProcess(popen, req.config, req.tag, pty_fd, stdin_fd, out_fds)
        self._procs[proc.pid] = proc
        loop = asyncio.get_running_loop()
        for fd in out_fds:
            proc._open_fds.add(fd)
            loop.add_reader(fd, proc._on_readable, fd)
        reaper = asyncio.create_task(self._reap(proc), name=f"reap-{proc.pid}")
        self._reapers.add(reaper)  # the loop keeps only weak references to tasks
        reaper.add_done_callback(self._reapers.discard)
        return proc

    async def _reap(self, proc: ManagedProcess) -> None:
        """Wait for exit via pidfd, drain output, publish the end event, then release everything."""
        await _wait_exit(proc.popen)
        returncode = proc.popen.wait()
        proc.reaped.set()
        if proc._kill_timer is not None:
            proc._kill_timer.cancel()
        while proc._open_fds:
            try:
                async with asyncio.timeout(DRAIN_AFTER_EXIT_S):
                    await proc.outputs_closed.wait()
            except TimeoutError:
                if not (proc._paused and proc.subscribers):
                    break  # a grandchild holds the pipe open; do not wait for it forever
        for fd in list(proc._open_fds):
            proc._close_output(fd)
        proc._abort_write()
        async with proc.stdin_lock:
            for input_fd in (proc.pty_fd, proc.stdin_fd):
                if input_fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(input_fd)
            proc.pty_fd = proc.stdin_fd = None
        proc.end = end_event(returncode)
        self._procs.pop(proc.pid, None)
        self._exits[proc.pid] = (time.monotonic(), proc.end, proc.tag)
        self._expire_exits()
        proc._publish({"end": proc.end})
        proc._publish(None)
        proc.subscribers.clear()
        proc.exited.set()

    def kill_all(self) -> None:
        for proc in self._procs.values():
            proc.signal(signal.SIGKILL)

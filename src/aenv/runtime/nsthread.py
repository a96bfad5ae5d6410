"""One call inside another process's namespace: on a thread of its own that enters the namespace
(``setns``), runs the call and ends, so no other thread of the server ever changes namespace. Used to
open the egress listener in a sandbox's network namespace and to name a sandbox's UTS namespace; and
(``in_private_mounts``) a thread in a mount namespace of its own, to spawn a process into it."""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# namespace file under /proc/<pid>/ns -> (its name in messages, its CLONE_NEW* flag)
KINDS = {"net": ("network", 0x40000000), "uts": ("UTS", 0x04000000)}
_CLONE_FS, _CLONE_NEWNS = 0x00000200, 0x00020000
_MS_REC, _MS_PRIVATE = 0x4000, 1 << 18


def _on_own_thread(call: Callable[[ctypes.CDLL], T], thread_name: str) -> T:
    """``call(libc)`` on a new thread that ends after it; its result, or its exception raised here."""
    out: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(call(ctypes.CDLL(None, use_errno=True)))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            errors.append(exc)

    t = threading.Thread(target=run, name=thread_name)
    t.start()
    t.join()
    if errors:
        raise errors[0]
    return out[0]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _enter(libc: ctypes.CDLL, pid: int, kind: str) -> None:
    """Move the calling thread into ``pid``'s ``kind`` namespace (an OSError naming it if it cannot)."""
    label, flag = KINDS[kind]
    fd = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(libc.setns(fd, flag), f"setns into the {label} namespace of {pid}")
    finally:
        os.close(fd)


def run_in_namespace(pid: int, kind: str, call: Callable[[ctypes.CDLL], T], *, thread_name: str) -> T:
    """``call(libc)`` in ``pid``'s ``kind`` namespace ("net" or "uts"); its result, or its exception
    (a failed ``setns`` is an OSError naming the namespace) raised here."""
    def enter_then_call(libc: ctypes.CDLL) -> T:
        _enter(libc, pid, kind)
        return call(libc)

    return _on_own_thread(enter_then_call, thread_name)


class NamespaceWorker:
    """One long-lived thread that runs calls in ``kind`` namespaces of other processes, one after
    another, entering each call's namespace first. For a call on every create (naming a pooled
    sandbox's UTS namespace): a new thread per call costs its start, a ``dlopen`` and a join, ~0.5 ms
    on the event loop of a busy 2-core host; a hand-off to this one, tens of µs. Only this thread
    ever changes namespace (it stays in the last one it entered: nothing else runs on it)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._jobs: queue.SimpleQueue[tuple[int, Callable[[ctypes.CDLL], Any], concurrent.futures.Future[Any]]] = (
            queue.SimpleQueue())
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def run(self, pid: int, call: Callable[[ctypes.CDLL], T]) -> T:
        """``call(libc)`` in ``pid``'s namespace; its result, or its exception raised here. Blocking."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=f"ns-{self.kind}", daemon=True)
                self._thread.start()
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((pid, call, done))
        return done.result()

    def _serve(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        while True:
            pid, call, done = self._jobs.get()
            try:
                _enter(libc, pid, self.kind)
                done.set_result(call(libc))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                done.set_exception(exc)


def in_private_mounts(prepare: Callable[[], None], then: Callable[[], T], *, thread_name: str) -> T:
    """``prepare()`` then ``then()`` on a thread of their own in a new private mount namespace
    (``unshare(CLONE_FS | CLONE_NEWNS)``: a thread may own one): mounts ``prepare`` makes are seen
    by that thread and by what ``then`` spawns from it, never by the server (the thread ends after).
    What a process launched only to mount and exec would do, without the exec (~30 ms an
    interpreter's start and imports): CRIU restores are spawned so (``checkpoint.restore_in_userns``)."""
    def unshare_then_call(libc: ctypes.CDLL) -> T:
        _check(libc.unshare(_CLONE_FS | _CLONE_NEWNS), "unshare of a mount namespace")
        libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
        _check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None),  # nothing back to the host
               "making the mount namespace private")
        prepare()
        return then()

    return _on_own_thread(unshare_then_call, thread_name)

"""One call inside another process's namespace: on a thread of its own that enters the namespace
(``setns``), runs the call and ends, so no other thread of the server ever changes namespace. Used to
open the egress listener in a sandbox's network namespace and to name a sandbox's UTS namespace."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# namespace file under /proc/<pid>/ns -> (its name in messages, its CLONE_NEW* flag)
KINDS = {"net": ("network", 0x40000000), "uts": ("UTS", 0x04000000)}


def run_in_namespace(pid: int, kind: str, call: Callable[[ctypes.CDLL], T], *, thread_name: str) -> T:
    """``call(libc)`` in ``pid``'s ``kind`` namespace ("net" or "uts"); its result, or its exception
    (a failed ``setns`` is an OSError naming the namespace) raised here."""
    label, flag = KINDS[kind]
    out: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        try:
            fd = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if libc.setns(fd, flag) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns into the {label} namespace of {pid}: {os.strerror(err)}")
            finally:
                os.close(fd)
            out.append(call(libc))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            errors.append(exc)

    t = threading.Thread(target=run, name=thread_name)
    t.start()
    t.join()
    if errors:
        raise errors[0]
    return out[0]

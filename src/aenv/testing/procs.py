"""Harnesses that start servers, registries or engines end them however they are stopped.

Two pieces, used by the bench, the SDK-suite runner and ``aenv.testing.server``:

* :func:`unwind_on_signals`: SIGTERM (what ``timeout``, CI runners and process managers send) unwinds
  like Ctrl-C, so every ``finally`` and ``ExitStack`` callback runs; a second signal while that clean-up
  is under way is ignored (it would leave half of it undone), a third one stops at once.
* :func:`exit_with_parent`: a ``preexec_fn`` that asks the kernel to SIGTERM the child when the process
  that started it dies, SIGKILL included (``PR_SET_PDEATHSIG``). The child then stops gracefully, which
  for a throwaway server means its sandboxes go too (``stop_sandboxes_on_exit``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)  # loaded here, not in the forked child


def exit_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when this process dies.

    The kernel sends it when the *thread* that forked the child ends, so this returns None (no
    death signal) off the main thread, where a short-lived worker thread would stop the child early."""
    if threading.current_thread() is not threading.main_thread():
        return None
    parent = os.getpid()

    def arm() -> None:
        _libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the death signal was armed
            os.kill(os.getpid(), sig)

    return arm


class _Unwinder:
    def __init__(self, say: Callable[[str], None], term_interrupts: bool) -> None:
        self.count = 0
        self.say = say
        self.term_interrupts = term_interrupts

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        self.count += 1
        name = signal.Signals(signum).name
        if self.count == 1:
            self.say(f"{name}: stopping, ending what this run started (servers, sandboxes, engines, temp dirs)")
            if signum == signal.SIGINT or self.term_interrupts:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        if self.count == 2:
            self.say(f"{name}: still cleaning up; one more signal stops at once and leaves processes behind")
            return
        raise SystemExit(128 + signum)


def unwind_on_signals(say: Callable[[str], None] | None = None, *, term_interrupts: bool = False) -> None:
    """SIGINT raises KeyboardInterrupt and SIGTERM ``SystemExit(143)`` in the main thread, once; see the
    module docstring. ``term_interrupts``: SIGTERM raises KeyboardInterrupt too (pytest tears its
    fixtures down after one, where a SystemExit would be a failed test and the session would go on).
    Call from the main thread (``signal.signal`` requires it)."""
    handler = _Unwinder(say or (lambda line: print(line, file=sys.stderr, flush=True)), term_interrupts)
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)

"""KSM for the in-sandbox processes (ns): the agent and envd mark themselves mergeable, and what they
start inherits it, so the kernel's same-page merging (ksmd) may share their identical pages across
sandboxes. The host decides (``ksm`` setting, ``runtime/ksm.py``) and says so with ``--mergeable``.

``prctl(PR_SET_MEMORY_MERGE)`` marks the whole process (every mapping, present and future), is
inherited over fork and exec, and applies only to the caller. A CRIU restore brings back the marks of
the mappings it dumped but not the process-wide one, so :func:`rearm` is called again where a restored
process first hears from the host (the agent on each host session, envd on ``/init``): mappings and
children made after a restore are mergeable too.

**Only once idle** (``--merge-idle S``, the host's ``ksm_idle_s``): a page ksmd merged costs a
copy-on-write fault when it is next written, and a Python process writes all over its heap (reference
counts) as it serves a request. A sandbox merged while it waited in the pool, or while it works, pays
that on its next requests (measured: ~3 ms more per create and first command on 2 cores). So the mark
waits until the process has served nothing for ``S`` seconds, counted from its first :func:`rearm`
(envd: ``/init``, the hand-out; a pooled sandbox is never marked): the sandboxes that stay idle —
thousands waiting on a model — are merged; the ones at work are not touched. Once marked a process
stays marked (unmarking would unmerge every page at once) and a restore of it is marked again at once.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time

log = logging.getLogger("aenv.mergeable")

PR_SET_MEMORY_MERGE = 67  # linux/prctl.h, Linux 6.4
# Module state survives a CRIU restore with the rest of the process's memory.
_wanted = False  # set once by enable()
_idle_s = 0.0  # mark only after this long without activity (0: at once)
_marked = False  # prctl succeeded once: a restore marks again at once
_last = 0.0  # time.monotonic() of the last activity
_pending = False  # a check is scheduled on the running loop


def enable(idle_s: float = 0.0) -> bool:
    """Mark this process (and what it starts from then on) mergeable: at once with ``idle_s`` 0,
    else ``idle_s`` after the activity that follows :func:`rearm`. Whether it is marked now."""
    global _wanted, _idle_s
    _wanted, _idle_s = True, max(0.0, idle_s)
    return _mark() if _idle_s == 0 else False


def touch() -> None:
    """Activity now: a pending mark waits another ``idle_s``. Costs a clock read."""
    global _last
    _last = time.monotonic()


def rearm() -> bool:
    """The host is here (a restore, a hand-out, a session): mark again at once if this process was
    marked before (or marks without waiting), else count idle time from now. Call from the event loop.
    Whether it is marked."""
    if not _wanted:
        return False
    if _marked or _idle_s == 0:
        return _mark()
    touch()
    _schedule(_idle_s)
    return False


def marked() -> bool:
    return _marked


def wanted() -> bool:
    """Whether the host asked for merging (``--mergeable``), marked yet or not."""
    return _wanted


def _schedule(delay: float) -> None:
    global _pending
    if _pending:
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # no loop (a test, a sync caller): the next rearm() from a loop schedules
        return
    _pending = True
    loop.call_later(delay, _check)


def _check() -> None:
    global _pending
    _pending = False
    left = _last + _idle_s - time.monotonic()
    if left > 0:
        _schedule(left)
    else:
        _mark()


def _prctl_merge() -> int:
    """``prctl(PR_SET_MEMORY_MERGE, 1)``: 0, or the errno."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_MEMORY_MERGE, 1, 0, 0, 0) != 0:
        return ctypes.get_errno() or -1
    return 0


def _mark() -> bool:
    global _marked
    if err := _prctl_merge():
        log.warning("prctl(PR_SET_MEMORY_MERGE) failed: %s (kernel < 6.4?): pages stay unmerged", err)
        return False
    _marked = True
    return True

"""KSM for the in-sandbox processes (ns): the agent and envd mark themselves mergeable, and what they
start inherits it, so the kernel's same-page merging (ksmd) may share their identical pages across
sandboxes. The host decides (``ksm`` setting, ``runtime/ksm.py``) and says so with ``--mergeable``.

``prctl(PR_SET_MEMORY_MERGE)`` marks the whole process (every mapping, present and future), is
inherited over fork and exec, and applies only to the caller. A CRIU restore brings back the marks of
the mappings it dumped but not the process-wide one, so :func:`rearm` is called again where a restored
process first hears from the host (the agent on each host session, envd on ``/init``): mappings and
children made after a restore are mergeable too.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("aenv.mergeable")

PR_SET_MEMORY_MERGE = 67  # linux/prctl.h, Linux 6.4
_wanted = False  # set once by enable(); survives a CRIU restore with the rest of the process's memory


def enable() -> bool:
    """Mark this process (and what it starts from now on) mergeable; remembered for :func:`rearm`."""
    global _wanted
    _wanted = True
    return rearm()


def rearm() -> bool:
    """Mark this process mergeable again if :func:`enable` was called; whether it is marked."""
    if not _wanted:
        return False
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_MEMORY_MERGE, 1, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_MEMORY_MERGE) failed: %s (kernel < 6.4?): pages stay unmerged",
                    ctypes.get_errno())
        return False
    return True

"""Host memory pressure: paused VMs go to disk at once when the host runs low on memory.

A paused VM holds its guest RAM until ``vm_release_paused_after`` has passed (a short pause, the
common case while an agent waits for its LLM, should resume from RAM). When the host's
``MemAvailable`` falls below ``vm_memory_low_mb``, waiting is the wrong trade: the runtime releases
paused VMs now, the longest-paused first, one at a time, re-reading ``MemAvailable`` after each, until
the host is above the mark again or no paused VM is left in RAM. Running VMs are never touched.
"""

from __future__ import annotations

from pathlib import Path

MEMINFO = Path("/proc/meminfo")


def mem_available_mb(meminfo: Path = MEMINFO) -> float | None:
    """The kernel's estimate of memory available for new work, in MB (None if unreadable)."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            try:
                return int(parts[1]) / 1024  # kB
            except (IndexError, ValueError):
                return None
    return None


def release_order(paused_since: dict[str, float]) -> list[str]:
    """Sandbox IDs in the order pressure releases them: the longest-paused first (the least likely
    to be resumed soon), ties by ID so the order is stable."""
    return [sid for sid, _ in sorted(paused_since.items(), key=lambda item: (item[1], item[0]))]


def under_pressure(available_mb: float | None, low_mb: float) -> bool:
    """True when a release is due: the mark is set and the host is below it (unknown = no)."""
    return low_mb > 0 and available_mb is not None and available_mb < low_mb

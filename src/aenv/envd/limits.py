"""Resource limits inside a vm guest: a ``sandbox`` cgroup for envd and every process it starts.

In the ns runtime the host puts the whole sandbox in its own cgroups. A vm guest is limited from the
outside by its RAM size only, and it has no process limit at all: a fork bomb fills the guest's
process table, and a memory bomb pushes the guest kernel into reclaim that evicts the agent's and
envd's own code (under TCG the guest then stops answering for minutes before the global OOM killer
acts). So the vm host asks envd, in ``POST /init``, to move itself into ``/sys/fs/cgroup/sandbox``
with ``pids.max`` and a ``memory.max`` some MB below what the guest has available: processes started
afterwards inherit the cgroup, a bomb hits those limits, and the OOM killer picks inside the cgroup,
while the agent (PID 1) and the kernel keep the reserve. The limit is taken from MemAvailable, not
MemTotal: what the agent and envd already use stays charged outside (cgroup v2 does not move a
process's earlier charges with it).
"""

from __future__ import annotations

import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
SANDBOX_CGROUP = "sandbox"
MIN_MEMORY_MB = 16


def mem_available_mb(meminfo: Path = Path("/proc/meminfo")) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    raise OSError("no MemAvailable in /proc/meminfo")


def apply(pids: int | None, memory_reserve_mb: int | None, root: Path = CGROUP_ROOT,
          meminfo: Path = Path("/proc/meminfo")) -> str:
    """Create (or reuse) the sandbox cgroup, set its limits and move this process into it.
    Returns what was set, e.g. ``"pids:300;memory:86M"``. Raises OSError where cgroup v2 or a
    controller is missing."""
    controllers = set((root / "cgroup.controllers").read_text().split())
    wanted = [c for c, v in (("pids", pids), ("memory", memory_reserve_mb)) if v is not None]
    missing = [c for c in wanted if c not in controllers]
    if missing:
        raise OSError(f"cgroup controllers missing in the guest: {', '.join(missing)}")
    if wanted:
        (root / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in wanted))
    cgroup = root / SANDBOX_CGROUP
    cgroup.mkdir(exist_ok=True)
    done = []
    if pids is not None:
        (cgroup / "pids.max").write_text(str(pids))
        done.append(f"pids:{pids}")
    if memory_reserve_mb is not None:
        limit_mb = max(MIN_MEMORY_MB, mem_available_mb(meminfo) - memory_reserve_mb)
        (cgroup / "memory.max").write_text(str(limit_mb * 1024 * 1024))
        done.append(f"memory:{limit_mb}M")
    (cgroup / "cgroup.procs").write_text(str(os.getpid()))
    return ";".join(done)


def parse(body: dict[str, object]) -> tuple[int | None, int | None] | None:
    """``{"limits": {"pids": N, "memoryReserveMB": M}}`` of an init body; None without it."""
    limits = body.get("limits")
    if limits is None:
        return None
    if not isinstance(limits, dict):
        raise ValueError("limits must be an object")
    out: list[int | None] = []
    for key in ("pids", "memoryReserveMB"):
        value = limits.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"limits.{key} must be a positive integer")
        out.append(value)
    return out[0], out[1]

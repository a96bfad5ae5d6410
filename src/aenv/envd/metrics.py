"""``GET /metrics``: sandbox resource usage read from ``/proc`` inside the sandbox.

Shape (envd's): ``{ts, cpu_count, cpu_used_pct, mem_total, mem_used, mem_cache,
mem_total_mib, mem_used_mib, disk_used, disk_total}``. CPU usage is the busy share
since the previous call (the first call measures over a short sample).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any


def _cpu_times(path: str = "/proc/stat") -> tuple[int, int]:
    """(busy, total) jiffies summed over all CPUs."""
    with open(path, encoding="ascii") as fh:
        fields = [int(v) for v in fh.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])
    return total - idle, total


def _meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    out: dict[str, int] = {}
    with open(path, encoding="ascii") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[key] = int(parts[0]) * 1024
    return out


class MetricsSampler:
    def __init__(self) -> None:
        self._last: tuple[int, int] | None = None

    async def cpu_used_pct(self) -> float:
        if self._last is None:
            self._last = _cpu_times()
            await asyncio.sleep(0.1)
        busy, total = _cpu_times()
        last_busy, last_total = self._last
        self._last = (busy, total)
        if total <= last_total:
            return 0.0
        return round(100.0 * (busy - last_busy) / (total - last_total), 2)

    async def sample(self) -> dict[str, Any]:
        cpu = await self.cpu_used_pct()
        mem = _meminfo()
        total = mem.get("MemTotal", 0)
        available = mem.get("MemAvailable", mem.get("MemFree", 0))
        cache = mem.get("Cached", 0) + mem.get("Buffers", 0)
        used = max(total - available, 0)
        fs = os.statvfs("/")
        disk_total = fs.f_blocks * fs.f_frsize
        disk_used = (fs.f_blocks - fs.f_bfree) * fs.f_frsize
        return {
            "ts": int(time.time()),
            "cpu_count": os.cpu_count() or 1,
            "cpu_used_pct": cpu,
            "mem_total": total,
            "mem_used": used,
            "mem_cache": cache,
            "mem_total_mib": total // (1024 * 1024),
            "mem_used_mib": used // (1024 * 1024),
            "disk_used": disk_used,
            "disk_total": disk_total,
        }

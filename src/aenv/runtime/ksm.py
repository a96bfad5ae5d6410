"""Kernel same-page merging (KSM) for sandboxes: whether it is on, the host's ksmd set up to merge
within a CPU budget, and what it saves.

Idle sandboxes hold mostly the same pages: on ns every one runs the agent and envd, restored by CRIU
from one process image of the template, so their heaps start byte-identical; on vm every guest boots
the same kernel from the same template RAM. ksmd finds identical anonymous pages of *mergeable*
processes and keeps one copy (copy-on-write). Marking: ns sandboxes' agent and envd mark themselves
(``--mergeable``, ``envd/mergeable.py``) and the sandbox's processes inherit it; a vm sandbox's guest RAM
is marked by QEMU (``-M mem-merge``).

**The side channel.** A write to a merged page takes a copy-on-write fault, so a process can tell by
timing whether some other process holds a page with the same contents: one tenant may learn whether
another holds a given page (a known file, a key it guesses). So ``ksm = "auto"`` (the default) merges
only while this server serves one team (``aenv/teams.py``: the teams of its keys, the admin team
included; several keys of one team are one tenant); with two or more teams it merges nothing, so no
page is ever merged across teams, and says so. ``"on"`` merges whatever the teams (an operator's explicit choice: one team, or trusted
tenants), ``"off"`` never marks anything and leaves the host's ksmd alone.

The host's ksmd is host-wide: the server starts it (``run`` 0 → 1) when merging is on and bounds its CPU
with the kernel's scan-time advisor (``advisor_max_cpu`` % of one CPU, ``ksm_max_cpu``). By default
(``ksm_merge_below = 1``) it never stops it while it serves (one that found ksmd stopped stops it
again when it closes, ``Ksm.close``): unmerging would need the memory back at once, and other
users of the host may rely on it. Below 1, ksmd scans only while memory is short and is paused
(``run`` = 0: merged pages stay merged) once ``MemAvailable`` is back above the share plus ``HYSTERESIS``
(checked with the metrics sampler, ``Ksm.adjust``): merging costs creates and first commands ~3 ms
(measured, 2 cores: pooled sandboxes merged while they waited break their pages back apart when they
start work, and ksmd takes CPU), which buys nothing while memory is plentiful. And with ``ksm_rest``
(the default) ksmd rests once merging has settled and scans again when a sandbox starts
(``ksm_rest.py``). Several servers on one host share the one ksmd: a server that still merges
starts it again if another rested it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aenv.config import Settings
from aenv.runtime.ksm_rest import RestPolicy

log = logging.getLogger("aenv.runtime.ksm")

SYSFS = Path("/sys/kernel/mm/ksm")
_PAGE = os.sysconf("SC_PAGE_SIZE")
HYSTERESIS = 0.1  # share of MemTotal above ksm_merge_below before ksmd is paused again
_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class KsmDecision:
    merge: bool
    reason: str


def decide(settings: Settings) -> KsmDecision:
    """Whether this server's sandboxes are mergeable, and why (see the module docstring)."""
    if settings.ksm == "off":
        return KsmDecision(False, "ksm = off")
    if settings.ksm == "on":
        return KsmDecision(True, "ksm = on (every tenant's sandboxes merged together)")
    teams = len(settings.team_directory().teams())  # the admin team counts: it is a tenant of its own
    if teams > 1:
        return KsmDecision(False, f"ksm = auto and {teams} teams: no page is merged, so none across teams "
                                  "(a merged page is a timing side channel); set ksm = on to merge anyway")
    return KsmDecision(True, "ksm = auto, one tenant (" + ("no API keys" if not teams else "one team") + ")")


def start_ksmd(max_cpu: int, sysfs: Path = SYSFS) -> str:
    """Run ksmd with the scan-time advisor bounding its CPU; what was done, or why nothing could be."""
    if not (sysfs / "run").exists():
        return "unavailable: the kernel has no KSM (/sys/kernel/mm/ksm)"
    try:
        if (sysfs / "advisor_mode").exists():
            (sysfs / "advisor_max_cpu").write_text(str(max_cpu))
            (sysfs / "advisor_mode").write_text("scan-time")
        if (sysfs / "run").read_text().strip() != "1":
            (sysfs / "run").write_text("1")
            return f"ksmd started (advisor: at most {max_cpu}% of one CPU)"
        return f"ksmd already running (advisor: at most {max_cpu}% of one CPU)"
    except OSError as exc:
        return f"unavailable: cannot set up ksmd ({exc.strerror or exc}; needs root and a writable /sys)"


def memory_kb(meminfo: Path = Path("/proc/meminfo")) -> tuple[int, int] | None:
    """(``MemTotal``, ``MemAvailable``) in kB, or None where they cannot be read."""
    fields: dict[str, int] = {}
    with contextlib.suppress(OSError, ValueError):
        for line in meminfo.read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in ("MemTotal", "MemAvailable"):
                fields[name] = int(rest.split()[0])
    if len(fields) < 2 or not fields["MemTotal"]:
        return None
    return fields["MemTotal"], fields["MemAvailable"]


def memory_share(meminfo: Path = Path("/proc/meminfo")) -> float | None:
    """``MemAvailable`` ÷ ``MemTotal``, or None where they cannot be read."""
    kb = memory_kb(meminfo)
    return None if kb is None else kb[1] / kb[0]


def _read_int(path: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(path.read_text().split()[0])
    return None


_ksmd_pid: int | None = None


def _find_ksmd() -> int | None:
    with os.scandir("/proc") as entries:
        for entry in entries:
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if Path(entry.path, "comm").read_text().strip() == "ksmd":
                        return int(entry.name)
    return None


def ksmd_cpu_seconds() -> float | None:
    """CPU time ksmd (a kernel thread, found once) has used since boot: what merging costs."""
    global _ksmd_pid
    for _ in range(2):
        if _ksmd_pid is None and (_ksmd_pid := _find_ksmd()) is None:
            return None
        with contextlib.suppress(OSError):
            if Path(f"/proc/{_ksmd_pid}/comm").read_text().strip() == "ksmd":
                stat = Path(f"/proc/{_ksmd_pid}/stat").read_text()
                fields = stat[stat.rindex(")") + 2 :].split()
                return (int(fields[11]) + int(fields[12])) / _TICKS  # utime + stime
        _ksmd_pid = None
    return None


def stats(decision: KsmDecision, sysfs: Path = SYSFS, ksmd: str | None = None) -> dict[str, Any]:
    """What ``/aenv/info``, ``/metrics`` and ``aenv doctor`` show: whether this server's sandboxes
    merge and why, and the host's counters (host-wide: other mergeable processes count too)."""
    out: dict[str, Any] = {"merge": decision.merge, "reason": decision.reason}
    if ksmd is not None:
        out["ksmd"] = ksmd
    run = _read_int(sysfs / "run")
    if run is None:
        return out
    shared, sharing = _read_int(sysfs / "pages_shared") or 0, _read_int(sysfs / "pages_sharing") or 0
    out.update({
        "running": run == 1,
        "pagesShared": shared,  # distinct pages kept for merged content
        "pagesSharing": sharing,  # pages mapped onto them: about what merging saves
        "sharedBytes": shared * _PAGE,
        "mergedBytes": sharing * _PAGE,
        "profitBytes": _read_int(sysfs / "general_profit"),  # saved less KSM's own metadata
        "fullScans": _read_int(sysfs / "full_scans"),
        "ksmdCpuSeconds": ksmd_cpu_seconds(),
    })
    return out


def prometheus(stat: dict[str, Any]) -> list[str]:
    """``/metrics`` lines for :func:`stats`."""
    lines = ["# HELP aenv_ksm_merge Whether this server's sandboxes are mergeable (the ksm setting)",
             "# TYPE aenv_ksm_merge gauge", f"aenv_ksm_merge {int(bool(stat['merge']))}"]
    for key, name, kind, what in (
        ("sharedBytes", "aenv_ksm_shared_bytes", "gauge", "Bytes of distinct pages KSM keeps for merged content"),
        ("mergedBytes", "aenv_ksm_merged_bytes", "gauge", "Bytes of pages mapped onto shared ones (host-wide)"),
        ("profitBytes", "aenv_ksm_profit_bytes", "gauge", "Bytes KSM saves, less its metadata (host-wide)"),
        ("ksmdCpuSeconds", "aenv_ksm_cpu_seconds_total", "counter", "CPU time ksmd has used since boot"),
    ):
        if stat.get(key) is not None:
            lines += [f"# HELP {name} {what}", f"# TYPE {name} {kind}", f"{name} {stat[key]}"]
    return lines


class Ksm:
    """One server's policy and what it did to the host's ksmd."""

    def __init__(self, settings: Settings, sysfs: Path = SYSFS, meminfo: Path = Path("/proc/meminfo")) -> None:
        self.settings = settings
        self.decision = decide(settings)
        self.sysfs = sysfs
        self.meminfo = meminfo
        self.ksmd: str | None = None
        self.scanning = False  # ksmd scans for this server now (ksm_merge_below)
        self.rest = RestPolicy(settings.ksm_idle_s) if settings.ksm_rest else None
        self.resting = False  # rested by this server: merging settled (ksm_rest)
        self.started_it = False  # this server found ksmd stopped and started it

    def start(self) -> None:
        """When this server's sandboxes merge, the host's ksmd runs within ``ksm_max_cpu`` (blocking),
        at once or, with ``ksm_merge_below`` < 1, once memory is short (:meth:`adjust`)."""
        if self.decision.merge:
            self.adjust()
        log.info("ksm: %s%s", self.decision.reason, f"; {self.ksmd}" if self.ksmd else "")

    def adjust(self, available_share: float | None = None, running: Iterable[str] | None = None,
               now: float | None = None) -> None:
        """Start ksmd when memory is short (``MemAvailable`` below ``ksm_merge_below`` of ``MemTotal``, or
        always at 1), pause it when it is ``HYSTERESIS`` above again; with ``ksm_rest``, rest it once
        merging has settled and wake it when one of ``running`` (the IDs of the running sandboxes) is
        new. Blocking; called periodically."""
        if not self.decision.merge:
            return
        now = time.monotonic() if now is None else now
        started = self.rest is not None and running is not None and self.rest.note(running, now)
        if self.resting and not self._wakes(started):
            return
        below = self.settings.ksm_merge_below
        # at 1 nothing depends on memory: /proc/meminfo is not read every sampler round
        share = None if below >= 1 else available_share if available_share is not None else memory_share(self.meminfo)
        short = below >= 1 or (share is not None and share < below)
        if short and not self.scanning:
            self.ksmd = start_ksmd(self.settings.ksm_max_cpu, self.sysfs)
            self.scanning = not self.ksmd.startswith("unavailable")
            self.started_it = self.started_it or self.ksmd.startswith("ksmd started")
            if below < 1:
                log.info("ksm: MemAvailable %.0f%% of MemTotal, below %.0f%%: %s", 100 * (share or 0), 100 * below,
                         self.ksmd)
        elif self.scanning and share is not None and share > below + HYSTERESIS:
            if self._stop():
                self.ksmd = f"ksmd paused (MemAvailable {100 * share:.0f}% of MemTotal, above {100 * below:.0f}%)"
                log.info("ksm: %s", self.ksmd)
        elif self.scanning:
            if _read_int(self.sysfs / "run") == 0:  # another server on this host rested it: ours still merge
                self.ksmd = start_ksmd(self.settings.ksm_max_cpu, self.sysfs)
            self._rest_if_settled(now)

    def close(self) -> None:
        """The server stops: a ksmd it found stopped and started is stopped again (merged pages stay
        merged), rather than scanning on for nobody (3 % of a core with nothing to merge, measured). A
        ksmd that ran before it came, or that ``ksm_merge_below`` or a rest already stopped, is left as
        it is; another server still merging starts it again on its next sampler round. Blocking."""
        if self.started_it and self.scanning and _read_int(self.sysfs / "run") == 1 and self._stop():
            log.info("ksm: ksmd stopped again as this server found it")

    def _stop(self) -> bool:
        try:
            (self.sysfs / "run").write_text("0")  # stop scanning; merged pages stay merged
        except OSError as exc:
            log.warning("ksm: cannot pause ksmd: %s", exc)
            return False
        self.scanning = False
        return True

    def _rest_if_settled(self, now: float) -> None:
        if self.rest is None:
            return
        scans, sharing = _read_int(self.sysfs / "full_scans"), _read_int(self.sysfs / "pages_sharing")
        if scans is None or sharing is None or not self.rest.settled(scans, sharing, now) or not self._stop():
            return
        kb = memory_kb(self.meminfo)
        self.rest.rested(kb[1] if kb else None, kb[0] if kb else None)
        self.resting = True
        self.ksmd = f"ksmd resting ({self.rest.why}); it scans again when a sandbox starts"
        log.info("ksm: %s", self.ksmd)

    def _wakes(self, started: bool) -> bool:
        """While resting: whether to scan again (a sandbox started, or memory crept down)."""
        assert self.rest is not None
        kb = memory_kb(self.meminfo)
        crept = self.rest.crept(kb[1] if kb else None)
        if not (started or crept):
            return False
        self.resting = False
        self.rest.restart()
        log.info("ksm: %s: ksmd scans again", "a sandbox started" if started else "MemAvailable fell since ksmd rested")
        return True

    def stats(self) -> dict[str, Any]:
        return {**stats(self.decision, self.sysfs, self.ksmd), "mergeBelow": self.settings.ksm_merge_below,
                "mergeIdleS": self.settings.ksm_idle_s, "rest": self.rest is not None, "resting": self.resting,
                "rests": self.rest.rests if self.rest is not None else 0}

    def prometheus(self) -> list[str]:
        return prometheus(self.stats()) + [
            "# HELP aenv_ksm_resting Whether this server rested ksmd because merging settled (ksm_rest)",
            "# TYPE aenv_ksm_resting gauge", f"aenv_ksm_resting {int(self.resting)}"]

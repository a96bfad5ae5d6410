"""Per-sandbox cgroups: limits, freezer, usage readings, cleanup.

Hosts differ: this machine kind is a v1 *hybrid* (cpu, cpuacct, memory, pids, freezer on v1, a
cgroup2 mount with only hugetlb), others are pure v2. ``detect()`` reads ``/proc/self/mountinfo`` at
run time and returns a layout; a ``Cgroup`` then hides which version it talks to.

Naming: every sandbox cgroup is ``<hierarchy>/aenv/<scope>/<name>``: ``name`` is the sandbox ID (or a
``pool-…`` ID until hand-out, when the directory is renamed) and ``scope`` is derived from the state
dir, so two servers (or a server and a test suite) on one host never reconcile away each other's
sandboxes. Everything one runtime ever created is found by listing its scope directory in each
hierarchy, which is what crash reconciliation does.

All functions here block (small file writes); callers in async code use threads where it matters.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

PARENT = "aenv"
V1_CONTROLLERS = ("cpu", "cpuacct", "memory", "pids", "freezer")
V2_CONTROLLERS = ("cpu", "memory", "pids")
CFS_PERIOD_US = 100_000


class CgroupError(OSError):
    pass


@dataclass(frozen=True)
class Layout:
    """Where the hierarchies are. v1: controller -> mount dir; v2: the unified mount dir."""

    version: int
    v1: dict[str, Path] = field(default_factory=dict)
    v2: Path | None = None
    scope: str = ""  # one runtime's subtree below aenv/ (see scope_for)

    def base(self, controller: str) -> Path:
        """The directory holding this runtime's sandbox cgroups in ``controller``'s hierarchy."""
        mount = self.v2 if self.version == 2 else self.v1[controller]
        assert mount is not None
        return mount / PARENT / self.scope if self.scope else mount / PARENT

    def parents(self) -> list[Path]:
        """That directory in every hierarchy we use (deduplicated)."""
        if self.version == 2:
            return [self.base("cpu")]
        seen: list[Path] = []
        for ctrl in self.v1:
            p = self.base(ctrl)
            if p not in seen:
                seen.append(p)
        return seen


def scope_for(state_dir: Path) -> str:
    """Stable short tag of a state dir: one server's cgroups never collide with another's."""
    import hashlib

    return "s" + hashlib.sha256(str(Path(state_dir).absolute()).encode()).hexdigest()[:10]


def _parse_mountinfo(text: str) -> tuple[dict[str, Path], Path | None]:
    v1: dict[str, Path] = {}
    v2: Path | None = None
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        rparts = right.split()
        if len(fields) < 5 or len(rparts) < 3:
            continue
        fstype, mountpoint, super_opts = rparts[0], Path(fields[4]), rparts[2].split(",")
        if fstype == "cgroup":
            for ctrl in V1_CONTROLLERS:
                if ctrl in super_opts and ctrl not in v1:
                    v1[ctrl] = mountpoint
        elif fstype == "cgroup2" and v2 is None:
            v2 = mountpoint
    return v1, v2


def detect(mountinfo: str | None = None, scope: str = "") -> Layout:
    """v1 when every controller we need is on a v1 hierarchy, else v2 when the unified hierarchy
    offers cpu, memory and pids."""
    text = mountinfo if mountinfo is not None else Path("/proc/self/mountinfo").read_text()
    v1, v2 = _parse_mountinfo(text)
    if all(c in v1 for c in V1_CONTROLLERS):
        return Layout(version=1, v1=v1, scope=scope)
    if v2 is not None:
        try:
            have = set((v2 / "cgroup.controllers").read_text().split())
        except OSError:
            have = set()
        if set(V2_CONTROLLERS) <= have:
            return Layout(version=2, v2=v2, scope=scope)
    raise CgroupError(errno.ENOTSUP, f"no usable cgroup layout (v1 has {sorted(v1)}, v2 at {v2})")


def _write(path: Path, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


def _read(path: Path) -> str:
    with open(path) as fh:
        return fh.read()


def _stat_map(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        with contextlib.suppress(ValueError):
            out[k] = int(v)
    return out


@dataclass
class Usage:
    cpu_ns: int
    mem_used: int
    mem_cache: int
    mem_limit: int


class Cgroup:
    """One sandbox's cgroup across all hierarchies. Owns the directories; ``remove`` is idempotent."""

    def __init__(self, layout: Layout, name: str) -> None:
        self.layout = layout
        self.name = name

    # ---- paths ----------------------------------------------------------------------------------
    def dir(self, controller: str) -> Path:
        return self.layout.base(controller) / self.name

    def dirs(self) -> list[Path]:
        return [p / self.name for p in self.layout.parents()]

    def procs_files(self) -> list[str]:
        """Files a process writes its pid into to join (the launcher does this before forking)."""
        return [str(d / "cgroup.procs") for d in self.dirs()]

    # ---- lifecycle ------------------------------------------------------------------------------
    def create(self) -> None:
        ensure_parents(self.layout)
        for d in self.dirs():
            d.mkdir(exist_ok=True)

    def exists(self) -> bool:
        return any(d.is_dir() for d in self.dirs())

    def rename(self, new_name: str) -> None:
        """Cgroup directories can be renamed in place (both v1 and v2): used at pool hand-out."""
        for parent in self.layout.parents():
            os.rename(parent / self.name, parent / new_name)
        self.name = new_name

    def set_limits(self, cpu_count: int, memory_mb: int, pids: int) -> None:
        quota = max(1, cpu_count) * CFS_PERIOD_US
        mem = max(16, memory_mb) * 1024 * 1024
        if self.layout.version == 2:
            _write(self.dir("cpu") / "cpu.max", f"{quota} {CFS_PERIOD_US}")
            _write(self.dir("memory") / "memory.max", str(mem))
            with contextlib.suppress(OSError):
                _write(self.dir("memory") / "memory.swap.max", "0")
            _write(self.dir("pids") / "pids.max", str(pids))
            return
        cpu = self.dir("cpu")
        _write(cpu / "cpu.cfs_period_us", str(CFS_PERIOD_US))
        _write(cpu / "cpu.cfs_quota_us", str(quota))
        memory = self.dir("memory")
        # v1 keeps memory.limit_in_bytes <= memory.memsw.limit_in_bytes at every write (EINVAL
        # otherwise): raising a limit (a pooled sandbox handed out with more memory) moves memsw first.
        with contextlib.suppress(OSError):
            if int(_read(memory / "memory.memsw.limit_in_bytes")) < mem:
                _write(memory / "memory.memsw.limit_in_bytes", str(mem))
        try:
            _write(memory / "memory.limit_in_bytes", str(mem))
        except OSError as exc:
            if exc.errno != errno.EBUSY:  # lowering below current usage: try to reclaim first
                raise
            with contextlib.suppress(OSError):
                _write(memory / "memory.force_empty", "0")
            _write(memory / "memory.limit_in_bytes", str(mem))
        with contextlib.suppress(OSError):
            _write(memory / "memory.memsw.limit_in_bytes", str(mem))
        _write(self.dir("pids") / "pids.max", str(pids))

    def set_weight(self, low: bool, high: bool = False) -> None:
        """CPU weight relative to other cgroups. Pooled sandboxes start with the lowest weight so a
        refill never steals CPU from live sandboxes (nice alone does not cross cgroups). ``high``: ten
        times the ordinary, for a hand-out's ``/init`` during a burst (``runtime.py``)."""
        if self.layout.version == 2:
            _write(self.dir("cpu") / "cpu.weight", "1" if low else "1000" if high else "100")
        else:
            _write(self.dir("cpu") / "cpu.shares", "2" if low else "10240" if high else "1024")

    def pids(self, controller: str | None = None) -> list[int]:
        """Members of every hierarchy (what kill and reconcile need), or of ``controller``'s alone
        (one read instead of one per hierarchy: the launcher joins all of them before forking)."""
        out: set[int] = set()
        for d in self.dirs() if controller is None else [self.dir(controller)]:
            with contextlib.suppress(OSError):
                out.update(int(x) for x in _read(d / "cgroup.procs").split())
        return sorted(out)

    # ---- freezer --------------------------------------------------------------------------------
    def freeze(self, timeout: float = 5.0) -> None:
        self._set_frozen(True, timeout)

    def thaw(self, timeout: float = 5.0) -> None:
        self._set_frozen(False, timeout)

    def frozen(self) -> bool:
        if self.layout.version == 2:
            return "frozen 1" in _read(self.dir("freezer") / "cgroup.events")
        return _read(self.dir("freezer") / "freezer.state").strip() == "FROZEN"

    def _set_frozen(self, frozen: bool, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        if self.layout.version == 2:
            _write(self.dir("freezer") / "cgroup.freeze", "1" if frozen else "0")
            while self.frozen() != frozen:
                if time.monotonic() > deadline:
                    raise CgroupError(errno.ETIMEDOUT, f"cgroup {self.name}: freeze={frozen} timed out")
                time.sleep(0.0005)
            return
        state = self.dir("freezer") / "freezer.state"
        want = "FROZEN" if frozen else "THAWED"
        _write(state, want)
        delay = 0.0002
        while _read(state).strip() != want:
            if time.monotonic() > deadline:
                raise CgroupError(errno.ETIMEDOUT, f"cgroup {self.name}: {want} timed out")
            _write(state, want)  # v1 may need a re-kick when new tasks raced in
            time.sleep(delay)
            delay = min(delay * 2, 0.005)

    # ---- readings -------------------------------------------------------------------------------
    def usage(self) -> Usage:
        if self.layout.version == 2:
            cpu = _stat_map(_read(self.dir("cpu") / "cpu.stat")).get("usage_usec", 0) * 1000
            mem = self.dir("memory")
            used = int(_read(mem / "memory.current"))
            cache = _stat_map(_read(mem / "memory.stat")).get("file", 0)
            raw = _read(mem / "memory.max").strip()
            limit = 0 if raw == "max" else int(raw)
            return Usage(cpu, used, cache, limit)
        cpu = int(_read(self.dir("cpuacct") / "cpuacct.usage"))
        mem = self.dir("memory")
        used = int(_read(mem / "memory.usage_in_bytes"))
        stat = _stat_map(_read(mem / "memory.stat"))
        cache = stat.get("total_cache", stat.get("cache", 0))
        limit = int(_read(mem / "memory.limit_in_bytes"))
        return Usage(cpu, used, cache, limit)

    def oom_kills(self) -> int:
        """How many processes the OOM killer took in this cgroup (tests, metrics)."""
        with contextlib.suppress(OSError):
            if self.layout.version == 2:
                return _stat_map(_read(self.dir("memory") / "memory.events")).get("oom_kill", 0)
            return _stat_map(_read(self.dir("memory") / "memory.oom_control")).get("oom_kill", 0)
        return 0

    # ---- teardown -------------------------------------------------------------------------------
    def kill_all(self) -> None:
        """SIGKILL every member, then thaw so frozen members can actually die."""
        if self.layout.version == 2:
            kill_file = self.dir("pids") / "cgroup.kill"
            if kill_file.exists():
                with contextlib.suppress(OSError):
                    _write(kill_file, "1")
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        knob = self.dir("freezer") / ("cgroup.freeze" if self.layout.version == 2 else "freezer.state")
        if knob.exists():
            with contextlib.suppress(OSError):
                _write(knob, "0" if self.layout.version == 2 else "THAWED")

    def remove(self, timeout: float = 5.0) -> None:
        """Kill leftovers and rmdir every directory; waits while dying tasks still hold it."""
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while True:
            busy = False
            for d in self.dirs():
                try:
                    d.rmdir()
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        raise
                    busy = True
            if not busy:
                return
            self.kill_all()
            if time.monotonic() > deadline:
                raise CgroupError(errno.EBUSY, f"cgroup {self.name} still busy after {timeout}s")
            time.sleep(delay)
            delay = min(delay * 2, 0.02)


def ensure_parents(layout: Layout) -> None:
    for parent in layout.parents():
        parent.mkdir(parents=True, exist_ok=True)
    if layout.version == 2:
        assert layout.v2 is not None
        want = " ".join(f"+{c}" for c in V2_CONTROLLERS)
        for d in (layout.v2, layout.v2 / PARENT, layout.base("cpu")):
            with contextlib.suppress(OSError):
                _write(d / "cgroup.subtree_control", want)


def list_names(layout: Layout) -> set[str]:
    """Names of every sandbox cgroup that exists in any hierarchy (for reconciliation)."""
    names: set[str] = set()
    for parent in layout.parents():
        with contextlib.suppress(FileNotFoundError):
            names.update(p.name for p in parent.iterdir() if p.is_dir())
    return names


def remove_scope_if_empty(layout: Layout) -> None:
    """Drop this runtime's scope directories when no sandbox cgroup is left in them (at close)."""
    if not layout.scope:
        return
    for parent in layout.parents():
        with contextlib.suppress(OSError):  # EBUSY/ENOTEMPTY: sandboxes still live there
            parent.rmdir()

"""Find what a test or bench run left behind: processes it started that outlived it, its mounts and
temp dirs. The test command (``scripts/setup.sh test``, docs/quickstart.md) records the machine before the suite and checks after it::

    python -m aenv.testing.leftovers record /tmp/before.json
    ...                                            # the suite
    python -m aenv.testing.leftovers check /tmp/before.json --kill

``check`` exits 1 naming each leftover (after ``--grace`` seconds for stops still under way), and with
``--kill`` ends them, so the next run starts clean. A process counts when it started after ``record``
and is one of the kinds a run starts (:data:`KINDS`): ns sandboxes show up as ``python3 -I -m
aenv.agent`` and ``aenv.envd``, which a ``pgrep aenv`` does not find.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK")


def _base(arg: str) -> str:
    return arg.rsplit("/", 1)[-1]


def _aenv_module(argv: list[str]) -> str | None:
    """``aenv.agent`` for ``python3 -I -m aenv.agent ...``; None if no ``-m aenv.*``."""
    for flag, mod in zip(argv, argv[1:], strict=False):
        if flag == "-m" and (mod == "aenv" or mod.startswith("aenv.")):
            return mod
    return None


def _aenv_cli(argv: list[str]) -> bool:
    return bool(argv) and _base(argv[0]) == "aenv" and len(argv) > 1 and argv[1] in ("serve", "gateway", "cluster")


# kind -> does this argv belong to it. Each is something a test, the bench or the set-up starts.
KINDS: dict[str, Callable[[list[str]], bool]] = {
    "aenv process (server, sandbox agent or envd, launcher, lazyd)":
        lambda a: _aenv_module(a) is not None or _aenv_cli(a),
    "slirp4netns": lambda a: _base(a[0]) == "slirp4netns",
    "QEMU": lambda a: _base(a[0]).startswith("qemu-system"),
    "docker engine": lambda a: _base(a[0]) in ("dockerd", "containerd") or _base(a[0]).startswith("containerd-shim"),
    "registry": lambda a: _base(a[0]) == "docker-registry",
    "redis": lambda a: _base(a[0]) == "redis-server",
    "seaweedfs": lambda a: _base(a[0]) == "weed",
    "ray": lambda a: _base(a[0]) in ("gcs_server", "raylet", "ray") or any("/site-packages/ray/" in x for x in a[:3]),
    "criu": lambda a: _base(a[0]) == "criu",
}  # fmt: skip


def _since_boot() -> float:
    """Now, on the clock process start times use (seconds since boot, suspend included)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@dataclass(frozen=True)
class Proc:
    pid: int
    started: float  # seconds since boot (/proc/PID/stat's starttime)
    argv: tuple[str, ...]

    @property
    def kind(self) -> str | None:
        return next((k for k, match in KINDS.items() if match(list(self.argv))), None)

    def mentions(self, marker: str) -> bool:
        """Whether its command line, environment or mounts name ``marker`` (a run's temp dir): a server
        has it in AENV_STATE_DIR, slirp4netns inherits that, an ns sandbox's root is an overlay of dirs
        under it, QEMU and dockerd have it on their command lines."""
        if any(marker in a for a in self.argv):
            return True
        needle = marker.encode()
        for name in ("environ", "mountinfo"):
            with contextlib.suppress(OSError):
                if needle in Path(f"/proc/{self.pid}/{name}").read_bytes():
                    return True
        return False

    def describe(self) -> str:
        cmd = " ".join(self.argv)
        return f"pid {self.pid} ({self.kind}, up {max(0.0, _since_boot() - self.started):.0f} s): {cmd[:200]}"


def processes() -> list[Proc]:
    """Every live (not zombie) process with a command line, this one excluded."""
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = Path(entry.path, "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
            if fields[0] in ("Z", "X"):
                continue
            raw = Path(entry.path, "cmdline").read_bytes().split(b"\0")
            argv = [a.decode(errors="replace") for a in raw if a]
            if argv:
                out.append(Proc(int(entry.name), int(fields[19]) / _TICKS, tuple(argv)))
    return out


def mountpoints() -> list[str]:
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4]
        out.append(point.encode().decode("unicode_escape"))  # mountinfo escapes spaces as \040
    return out


def watched_roots() -> list[str]:
    """Where runs put temp state: the temp dir (pytest's, the bench's, the SDK suite's) and /dev/shm."""
    return sorted({tempfile.gettempdir(), "/dev/shm"})


def _under(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def temp_entries() -> list[str]:
    """The run-owned dirs directly in the temp dir: ``aenv-*`` (bench, docker and runc baselines, SDK
    suite, cluster). pytest's own ``pytest-of-*`` dirs are kept on purpose (the last three runs)."""
    root = Path(tempfile.gettempdir())
    with contextlib.suppress(OSError):
        return sorted(str(p) for p in root.iterdir() if p.name.startswith(("aenv-", "aenvc")))
    return []


@dataclass
class Record:
    """The machine before a run: when it started, and the mounts and temp dirs already there."""

    started: float  # seconds since boot, as Proc.started
    mounts: list[str]
    temps: list[str]

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"started": self.started, "mounts": self.mounts, "temps": self.temps}))

    @classmethod
    def load(cls, path: Path) -> Record:
        raw = json.loads(path.read_text())
        return cls(float(raw["started"]), list(raw["mounts"]), list(raw.get("temps", [])))

    @classmethod
    def now(cls) -> Record:
        return cls(_since_boot(), mountpoints(), temp_entries())


@dataclass
class Found:
    procs: list[Proc]
    mounts: list[str]
    temps: list[str]

    def __bool__(self) -> bool:
        return bool(self.procs or self.mounts or self.temps)

    def lines(self) -> list[str]:
        return ([p.describe() for p in self.procs] + [f"mount {m}" for m in self.mounts]
                + [f"temp dir {t}" for t in self.temps])  # fmt: skip


def find(before: Record, roots: Iterable[str] | None = None, under: str | None = None) -> Found:
    """What started or appeared after ``before``: processes of :data:`KINDS`, mounts under ``roots``
    (default :func:`watched_roots`) and ``aenv-*`` temp dirs. ``under``: only processes that name
    that dir (:meth:`Proc.mentions`), for a check beside other runs."""
    roots = list(roots or watched_roots())
    procs = [p for p in processes() if p.started >= before.started - 1 / _TICKS and p.kind is not None
             and (under is None or p.mentions(under))]  # fmt: skip
    mounts = sorted(set(m for m in mountpoints() if _under(m, roots)) - set(before.mounts))
    temps = sorted(set(temp_entries()) - set(before.temps))
    return Found(sorted(procs, key=lambda p: p.pid), mounts, temps)


def wait_clean(before: Record, grace: float, roots: Iterable[str] | None = None, under: str | None = None) -> Found:
    """:func:`find`, again every 0.5 s for up to ``grace`` seconds while something is left (a stop
    that is still ending its children is not a leftover yet)."""
    deadline = time.monotonic() + grace
    while (found := find(before, roots, under)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return found


def _thaw(pid: int) -> None:
    """Let a frozen process (a paused sandbox's) take its SIGKILL: a v1 freezer holds it until thawed."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "freezer":
                Path(f"/sys/fs/cgroup/freezer{path}/freezer.state").write_text("THAWED")
            elif controllers == "" and Path(f"/sys/fs/cgroup{path}/cgroup.freeze").exists():
                Path(f"/sys/fs/cgroup{path}/cgroup.freeze").write_text("0")


def clean(found: Found) -> None:
    """SIGKILL the processes (thawing frozen ones), detach the mounts (deepest first), remove the temp dirs."""
    import shutil

    for p in found.procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p.pid, signal.SIGKILL)
        _thaw(p.pid)
    for m in sorted(found.mounts, key=len, reverse=True):
        subprocess.run(["umount", "-l", m], capture_output=True, check=False)
    for t in found.temps:
        if not any(_under(m, [t]) for m in mountpoints()):  # never rmtree through a live mount
            shutil.rmtree(t, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m aenv.testing.leftovers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="note the time, mounts and temp dirs before a run")
    rec.add_argument("file", type=Path)
    chk = sub.add_parser("check", help="exit 1 naming what the run left; 0 if nothing")
    chk.add_argument("file", type=Path, help="what `record` wrote")
    chk.add_argument("--grace", type=float, default=20.0, help="seconds to wait for stops under way [default: 20]")
    chk.add_argument("--kill", action="store_true", help="also end the leftovers (processes, mounts, temp dirs)")
    args = ap.parse_args(argv)
    if args.cmd == "record":
        Record.now().save(args.file)
        return 0
    found = wait_clean(Record.load(args.file), args.grace)
    if not found:
        print("leftover check: no process, mount or temp dir of the run outlived it", file=sys.stderr)
        return 0
    print(f"leftover check FAILED: {len(found.lines())} things the run started outlived it:", file=sys.stderr)
    for line in found.lines():
        print(f"  {line}", file=sys.stderr)
    if args.kill:
        clean(found)
        print("  (ended: processes killed, mounts detached, temp dirs removed)", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())

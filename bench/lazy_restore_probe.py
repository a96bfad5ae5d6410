"""Issue 35: do CRIU lazy restores (``ns_fork_lazy_pages``) make ns forks faster or smaller?

Two servers of this checkout side by side, the same but for that setting: ``eager`` (every page read
into place before a child runs: the default) and ``lazy`` (``criu restore --lazy-pages``, one
``criu lazy-pages`` daemon per child: ``runtime/ns/lazypages.py``). Each holds one ``base`` parent
whose process holds 48 MiB of random bytes (as ``bench/scale.py``'s fork parent), and each round
forks it ×1 and ×16 on one server, then on the other (the order alternates by round). Per fork:
the call, until every child answers (connect + ``true``), the restore of each child as the
server logs it, the host's MemAvailable drop ÷ children right after the call, after each child
ran its command and 3 s later (a lazy daemon copies the pages left after a second without a
fault), the host's busy CPU seconds from the call to the answers, and the daemons still alive.
KSM is off on both (the test server's default): the memory is before any merging.

    python -m bench.lazy_restore_probe            # 3 rounds; AENV_PROBE_ROUNDS, AENV_PROBE_SMOKE=1 (1 round, ×1 and ×4)

Writes a table and ``bench/results/issue35-lazy-restore/probe-<time>.json``.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

PORTS = {"eager": 8350, "lazy": 8351}
HOLD_48MIB = "python3 -c 'import os, time; b = os.urandom(48 << 20); time.sleep(1e9)'"
OUT = Path(__file__).parent / "results" / "issue35-lazy-restore"
RESTORED = re.compile(r"sandbox=(\S+) processes restored in ([\d.]+) ms lazy=(\w+)")
SETTLE_S = 3.0


def mem_available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable")


def busy_s() -> float:
    """Host-wide CPU seconds not idle (all cores): /proc/stat's first line."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = f[3] + f[4]
    return (sum(f[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def lazy_daemons() -> int:
    n = 0
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if b"lazy-pages\0-D" in (p / "cmdline").read_bytes():
                    n += 1
            except OSError:
                pass
    return n


def child_rss_mb(sids: list[str]) -> float | None:
    """Median anonymous memory (cgroup v1 ``memory.stat`` total_rss) of the children's cgroups:
    unlike MemAvailable, not moved by what else runs on the host."""
    vals = []
    for sid in sids:
        for stat in Path("/sys/fs/cgroup/memory/aenv").glob(f"*/{sid}/memory.stat"):
            for line in stat.read_text().splitlines():
                if line.startswith("total_rss "):
                    vals.append(int(line.split()[1]) / 2**20)
    return round(statistics.median(vals), 1) if vals else None


def load1() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def _answer(sid: str, kw: dict[str, Any]) -> float:
    from e2b import Sandbox

    t0 = time.perf_counter()
    Sandbox.connect(sid, **kw).commands.run("true")
    return (time.perf_counter() - t0) * 1000


class Side:
    """One server (eager or lazy) with its parent sandbox."""

    def __init__(self, name: str) -> None:
        from e2b import Sandbox

        from aenv.testing.server import API_KEY, start_server

        self.name = name
        self.tmp = Path(tempfile.mkdtemp(prefix=f"lazyfork-{name}-"))
        # no user namespace on either side: a task restored into one cannot open a userfaultfd here
        # (vm.unprivileged_userfaultfd = 0 asks for CAP_SYS_PTRACE in the host's namespace)
        env = {"AENV_POOL_SIZE": "0", "AENV_NS_USERNS_UID": "0",
               "AENV_NS_FORK_LAZY_PAGES": "1" if name == "lazy" else "0"}
        self.srv = start_server(self.tmp, "ns", env, port=PORTS[name])
        self.kw = {"api_url": self.srv.url, "sandbox_url": self.srv.url, "api_key": API_KEY}
        self.parent = Sandbox.create("base", timeout=3600, **self.kw)
        self.parent.commands.run(HOLD_48MIB, background=True, timeout=0).disconnect()  # no 60 s default
        time.sleep(3.0)

    def restores(self, since: int) -> list[float]:
        text = self.srv.log_path.read_bytes()[since:].decode(errors="replace")
        return [float(m.group(2)) for m in RESTORED.finditer(text)]

    def fork(self, n: int) -> dict[str, Any]:
        from e2b import Sandbox

        from aenv.client import AenvClient

        time.sleep(1.0)
        since = self.srv.log_path.stat().st_size
        m0, c0 = mem_available_mb(), busy_s()
        t0 = time.perf_counter()
        with AenvClient(self.srv.url, self.kw["api_key"], timeout=600) as client:
            res = client.fork(self.parent.sandbox_id, n, timeout=600)
        call = (time.perf_counter() - t0) * 1000
        m_call = mem_available_mb()
        kids = res.sandbox_ids
        with concurrent.futures.ThreadPoolExecutor(max(1, len(kids))) as pool:
            list(pool.map(lambda s: _answer(s, self.kw), kids))
        answered = (time.perf_counter() - t0) * 1000
        c1, m_cmd, alive, rss_cmd = busy_s(), mem_available_mb(), lazy_daemons(), child_rss_mb(kids)
        time.sleep(SETTLE_S)
        m_settled, alive_settled, c2, rss_settled = mem_available_mb(), lazy_daemons(), busy_s(), child_rss_mb(kids)
        restores = self.restores(since)
        for sid in kids:
            Sandbox.kill(sid, **self.kw)
        k = max(1, len(kids))
        return {"side": self.name, "n": n, "ok": len(kids), "errors": res.errors[:3], "mode": res.mode,
                "call_ms": round(call, 1), "all_answer_ms": round(answered, 1),
                "restore_ms_median": round(statistics.median(restores), 1) if restores else None,
                "restore_ms_max": round(max(restores), 1) if restores else None,
                "mem_per_child_mb_after_call": round((m0 - m_call) / k, 1),
                "mem_per_child_mb_after_cmd": round((m0 - m_cmd) / k, 1),
                "mem_per_child_mb_settled": round((m0 - m_settled) / k, 1),
                "child_rss_mb_at_answer": rss_cmd, "child_rss_mb_settled": rss_settled,
                "busy_cpu_s_to_answer": round(c1 - c0, 2), "busy_cpu_s_to_settled": round(c2 - c0, 2),
                "lazy_daemons_at_answer": alive, "lazy_daemons_settled": alive_settled, "load1": load1()}

    def close(self) -> None:
        from aenv.testing.server import stop_server

        stop_server(self.srv)
        shutil.copy(self.srv.log_path, Path(tempfile.gettempdir()) / f"lazyfork-server-{self.name}.log")
        if str(self.tmp) not in Path("/proc/mounts").read_text():
            shutil.rmtree(self.tmp, ignore_errors=True)


COLS = ("side", "n", "ok", "errors", "call_ms", "all_answer_ms", "restore_ms_median", "mem_per_child_mb_after_call",
        "mem_per_child_mb_after_cmd", "mem_per_child_mb_settled", "child_rss_mb_at_answer", "child_rss_mb_settled",
        "busy_cpu_s_to_answer",
        "busy_cpu_s_to_settled", "lazy_daemons_at_answer", "lazy_daemons_settled", "load1")
SHORT = ("side", "n", "ok", "errors", "call", "answer", "restore", "MB@call", "MB@cmd", "MB@+3s", "rss@ans", "rss@+3s", "cpu@ans", "cpu@+3s",
         "lz@ans", "lz@+3s", "load1")


def main() -> None:
    smoke = os.environ.get("AENV_PROBE_SMOKE") == "1"
    rounds = 1 if smoke else int(os.environ.get("AENV_PROBE_ROUNDS", "3"))
    counts = (1, 4) if smoke else (1, 16)
    sides: dict[str, Side] = {}
    rows: list[dict[str, Any]] = []
    started = time.strftime("%Y%m%d-%H%M%S")
    OUT.mkdir(parents=True, exist_ok=True)
    try:
        for name in ("eager", "lazy"):
            sides[name] = Side(name)
        for r in range(rounds):
            order = ("eager", "lazy") if r % 2 == 0 else ("lazy", "eager")
            for n in counts:
                for name in order:
                    try:
                        row = sides[name].fork(n) | {"round": r}
                    except Exception as exc:  # noqa: BLE001 - one failed fork is a result, not the end
                        row = dict.fromkeys(COLS) | {"side": name, "n": n, "round": r, "ok": 0,
                                                     "errors": [f"{type(exc).__name__}: {str(exc)[:200]}"]}
                    rows.append(row)
                    print("  ".join(f"{k}={row[k]}" for k in COLS), flush=True)
    finally:
        for side in sides.values():
            side.close()
    print("\n" + " | ".join(SHORT))
    for row in rows:
        print(" | ".join(str(row[k]) for k in COLS))
    summary: dict[str, Any] = {}
    for name in ("eager", "lazy"):
        for n in counts:
            sel = [x for x in rows if x["side"] == name and x["n"] == n]
            summary[f"{name} x{n}"] = {k: round(statistics.median(x[k] for x in sel if x[k] is not None), 1)
                                       for k in COLS[4:] if any(x[k] is not None for x in sel)} | {
                                           "failed_forks": sum(1 for x in sel if x["ok"] != x["n"])}
    print("\nmedians:")
    for key, med in summary.items():
        print(f"  {key}: " + ", ".join(f"{k}={v}" for k, v in med.items()))
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"probe-{started}{'-smoke' if smoke else ''}.json"
    path.write_text(json.dumps({"rounds": rows, "medians": summary, "smoke": smoke,
                                "cpus": os.cpu_count()}, indent=1))
    print(f"\nwritten {path}")


if __name__ == "__main__":
    main()

"""Density at scale (issue 35): idle sandboxes added in steps until the host's MemAvailable is down to half
of MemTotal or a count cap (2,000); then one parent forked into children; idle docker containers the
same way, in the same run.

Why a scenario of its own: ``density`` measures ten sandboxes, where PSS still charges each one a large
part of the shared template pages and nothing shows whether the server keeps up. What a node holds, what
one more sandbox really costs the host (MemAvailable, not a sum of PSS) and whether create and
``commands.run`` latencies hold as the count grows only show at scale.

* idle: ``base`` sandboxes, each with one idle process (``sleep infinity`` through ``commands.run``,
  background), made ``STEP`` at a time by a few threads. Per step: count, create p50/p99, MemAvailable,
  the server's RSS and its other processes', ksmd's counters (the series behind ``scale.png``). At the
  end: PSS of every sandbox and host memory per sandbox (MemAvailable drop ÷ count: all it costs, the
  kernel's share and the server's growth included), again once ksmd has scanned twice more; then
  ``commands.run("true")`` in every sandbox, in that merged, idle state.
* fork: one parent whose process holds 48 MiB of random bytes, forked 16 at a time: marginal host memory
  per child (MemAvailable drop ÷ children), right after and merged; PSS per child.
* docker: ``docker run -d … sleep infinity`` to the count aenv reached (or the memory floor, or its own
  cap): the same per-step series, host memory per container, PSS of container + shim, ``docker exec``.

It starts its own server (as density's ksm-off one does): ``max_sandboxes`` raised above the cap, and the
server's pid known, for its RSS. ns only. Not in ``all`` (a full run takes many minutes); run it by name::

    python -m bench --scenarios scale [--smoke]

Knobs (environment): AENV_BENCH_SCALE_MAX (count cap; 2000, smoke 6), AENV_BENCH_SCALE_STEP (50; smoke 3),
AENV_BENCH_SCALE_FORKS (64; smoke 4), AENV_BENCH_SCALE_DOCKER_MAX (docker's own cap; default: the count
aenv reached), AENV_BENCH_SCALE_KSM_WAIT (seconds to wait for ksmd's two scans; 300, smoke 15),
AENV_BENCH_SCALE_FLOOR (fraction of MemTotal that must stay available; 0.5).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from bench.context import Ctx
from bench.density import after_ksm, docker_pss, ns_pids, pss_mb
from bench.rows import Row, ms_since, pct, row, scenario, timed, value_row

if TYPE_CHECKING:
    from aenv.testing.server import Server
    from bench.baselines import DockerBaseline

console = Console(stderr=True)
FORK_BATCH = 16
PER_SANDBOX = ("reap", "unshare", "slirp4netns", "containerd-shim")  # children that serve one sandbox each
HOLD_48MIB = "python3 -c 'import os, time; b = os.urandom(48 << 20); time.sleep(1e9)'"
TARGET_PSS_MB, TARGET_FORK_MB = 8.0, 4.0  # issue 35's targets: an idle sandbox's PSS, a fork child's memory
TITLE = "density at scale: idle sandboxes until half the host's memory or a cap, fork children"


@dataclass(frozen=True)
class Knobs:
    cap: int  # idle sandboxes at most
    step: int  # made between two measurements
    forks: int  # fork children of the one parent
    docker_cap: int | None  # containers at most (None: as many as aenv reached)
    ksm_wait: float  # seconds to wait for ksmd's three full scans
    floor: float  # stop once MemAvailable <= floor × MemTotal
    threads: int  # creates at once

    @classmethod
    def from_env(cls, smoke: bool, env: Mapping[str, str] = os.environ) -> Knobs:
        def get(name: str, full: float, small: float) -> float:
            raw = env.get(f"AENV_BENCH_SCALE_{name}", "").strip()
            return float(raw) if raw else (small if smoke else full)

        docker = env.get("AENV_BENCH_SCALE_DOCKER_MAX", "").strip()
        knobs = cls(cap=int(get("MAX", 2000, 6)), step=int(get("STEP", 50, 3)), forks=int(get("FORKS", 64, 4)),
                    docker_cap=int(docker) if docker else None, ksm_wait=get("KSM_WAIT", 300, 15),
                    floor=get("FLOOR", 0.5, 0.5), threads=3 if smoke else 4)
        if min(knobs.cap, knobs.step, knobs.forks) < 1 or not 0 < knobs.floor < 1:
            raise ValueError(f"AENV_BENCH_SCALE_*: counts must be >= 1 and the floor in (0, 1): {knobs}")
        return knobs


# ---- pure parts (unit-tested) ------------------------------------------------------------------------
def meminfo(text: str | None = None) -> dict[str, int]:
    """``/proc/meminfo`` in kB, by field name."""
    out: dict[str, int] = {}
    for line in (Path("/proc/meminfo").read_text() if text is None else text).splitlines():
        key, _, rest = line.partition(":")
        with contextlib.suppress(ValueError, IndexError):
            out[key.strip()] = int(rest.split()[0])
    return out


def used_kb(mem: Mapping[str, int]) -> int:
    """Memory in use as ``free`` counts it (neither free nor page cache, buffers or reclaimable slab): a
    second view beside MemAvailable's drop, less moved by the page cache snapshots and images fill."""
    return mem["MemTotal"] - mem["MemFree"] - mem.get("Buffers", 0) - mem.get("Cached", 0) - mem.get("SReclaimable", 0)


def stop_reason(count: int, cap: int, available_kb: int, total_kb: int, floor: float) -> str | None:
    """Why a ramp stops before its next step, or None to go on. The memory floor counts only once there
    is something to measure: a host already past it still gets one step (and the row says why it ended)."""
    if count >= cap:
        return f"the cap of {cap} reached"
    if count and available_kb <= floor * total_kb:
        return f"MemAvailable {available_kb / 1024:.0f} MB, at most {floor:.0%} of MemTotal"
    return None


def step_record(count: int, latencies: list[float], mem: Mapping[str, int], base: Mapping[str, int], elapsed: float,
                extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One point of a ramp's series: where it stands after a step (``mem`` against ``base``, meminfo before
    the first create), and that step's create latencies."""
    return {"count": count, "create_p50_ms": round(statistics.median(latencies), 1),
            "create_p99_ms": round(pct(latencies, 99), 1), "mem_available_mb": round(mem["MemAvailable"] / 1024),
            "host_mb_each": round((base["MemAvailable"] - mem["MemAvailable"]) / 1024 / max(count, 1), 2),
            "used_mb_each": round((used_kb(mem) - used_kb(base)) / 1024 / max(count, 1), 2),
            "elapsed_s": round(elapsed, 1), **(extra or {})}  # fmt: skip


def spread(items: list[Any], most: int) -> list[Any]:
    """At most ``most`` of ``items``, evenly spaced, first and last included: a sample across a ramp."""
    if len(items) <= most:
        return list(items)
    return [items[round(i * (len(items) - 1) / (most - 1))] for i in range(most)] if most > 1 else items[:1]


def series_note(system: str, steps: list[dict[str, Any]], most: int = 8) -> str:
    """The series in a line of the table's notes: create p50/p99 and host MB per sandbox by count."""
    points = ", ".join(f"{s['count']}: {s['create_p50_ms']:.0f}/{s['create_p99_ms']:.0f} ms, {s['host_mb_each']:.1f} MB"
                       for s in spread(steps, most))
    return f"{system} by count (create p50/p99, host memory each): {points}"


# ---- the host and its processes --------------------------------------------------------------------
def rss_mb(pid: int) -> float:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def process_rss(root: int, per_sandbox: Iterable[str] = PER_SANDBOX) -> tuple[float, float, int]:
    """RSS (MB) of ``root`` (the server, dockerd), and of its children that serve no single sandbox (not
    a reaper, slirp4netns or shim: those are the sandbox's cost), with their count."""
    skip = set(per_sandbox)
    kids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(entry.path, "stat").read_text()
                comm, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
                if int(rest[1]) == root and comm not in skip:
                    kids.append(int(entry.name))
    return rss_mb(root), sum(rss_mb(k) for k in kids), len(kids)


def tasks() -> int:
    """Threads on the host (``/proc/loadavg``'s total): pid_max bounds them, and 2,000 sandboxes come near."""
    return int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])


def slirp_pid(state_dir: Path, sandbox_id: str) -> int | None:
    """The slirp4netns of an ns sandbox with internet access, from its ``ns.json`` (outside its cgroup,
    so ``ns_pids`` does not count it; it is still that sandbox's cost)."""
    with contextlib.suppress(OSError, ValueError, TypeError):
        slirp = json.loads((state_dir / "sandboxes" / sandbox_id / "ns" / "ns.json").read_text()).get("slirp")
        return int(slirp[0]) if slirp else None
    return None


def ns_pss(state_dir: Path, ids: list[str]) -> tuple[list[float], list[float]]:
    """PSS (MB) of each sandbox as density counts it (cgroup + reaper), and with its slirp4netns too."""
    bare, full = [], []
    for sid in ids:
        own = pss_mb(ns_pids(state_dir, sid))
        slirp = slirp_pid(state_dir, sid)
        bare.append(own)
        full.append(own + (pss_mb([slirp]) if slirp else 0.0))
    return bare, full


@dataclass
class Ramp:
    """One system's ramp: what it made (recorded as each create returns, so the clean-up finds all of it
    whatever stops the ramp) and what every step measured."""

    system: str
    ids: list[str] = field(default_factory=list)
    latencies: list[list[float]] = field(default_factory=list)  # one list per step
    steps: list[dict[str, Any]] = field(default_factory=list)
    reason: str = ""
    base: dict[str, int] = field(default_factory=dict)  # meminfo before the first create
    settles: int = 0  # waits for ksmd at the memory floor (``run``'s ``settle``)
    settled_at: int = -1
    wall_s: float = 0.0

    def run(self, create: Callable[[Callable[[str], None]], float], knobs: Knobs, cap: int,
            probe: Callable[[], dict[str, Any]], settle: Callable[[], object] | None = None) -> None:
        """``create(record)`` makes one, calls ``record(id)`` once it exists, returns its latency (ms).
        A failed create ends the ramp (its reason says so): what was made until then is measured.
        ``settle``: at the memory floor, wait for what the host gives back by itself (ksmd merging the
        sandboxes made so far) and go on if that lifts it above the floor, as a node that merges would;
        once per count, so a floor that stays ends the ramp."""
        self.base = meminfo()
        total = self.base["MemTotal"]
        t0 = time.monotonic()
        pool = concurrent.futures.ThreadPoolExecutor(knobs.threads, thread_name_prefix=f"scale-{self.system}")

        def why_stop() -> str | None:
            reason = stop_reason(len(self.ids), cap, meminfo()["MemAvailable"], total, knobs.floor)
            if reason is None or settle is None or not reason.startswith("MemAvailable") or self.settled_at == len(self.ids):
                return reason
            self.settled_at = len(self.ids)
            console.print(f"scale {self.system}: at the memory floor with {len(self.ids)}; waiting for ksmd", highlight=False)
            settle()
            self.settles += 1
            return stop_reason(len(self.ids), cap, meminfo()["MemAvailable"], total, knobs.floor)

        try:
            while (reason := why_stop()) is None:
                futures = [pool.submit(create, self.ids.append) for _ in range(min(knobs.step, cap - len(self.ids)))]
                lat: list[float] = []
                failed: BaseException | None = None
                for fut in futures:
                    try:
                        lat.append(fut.result())
                    except Exception as exc:  # noqa: BLE001 - the first failure ends the ramp, reported
                        failed = failed or exc
                if lat:
                    self.latencies.append(lat)
                    self.steps.append(step_record(len(self.ids), lat, meminfo(), self.base, time.monotonic() - t0,
                                                  probe()))
                    s = self.steps[-1]
                    console.print(f"scale {self.system}: {s['count']}, create p50/p99 {s['create_p50_ms']:.0f}/"
                                  f"{s['create_p99_ms']:.0f} ms, {s['host_mb_each']:.1f} MB each, "
                                  f"MemAvailable {s['mem_available_mb']} MB", highlight=False)
                if failed is not None:
                    reason = f"a create failed at {len(self.ids)}: {type(failed).__name__}: {str(failed)[:200]}"
                    break
            self.reason = reason
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            self.wall_s = time.monotonic() - t0

    def memory_row(self, metric: str, mem: Mapping[str, int], note: str) -> Row:
        """Host memory per sandbox: MemAvailable's drop since the first create ÷ count; ``free``'s used in the note."""
        return each_row(metric, self.system, self.base, mem, len(self.ids), note)

    def rows(self, unit_name: str, cap_note: str = "") -> list[Row]:
        """Count reached and create latency of the first and last steps (the series has the rest)."""
        n = len(self.ids)
        out = [value_row("scale: idle sandboxes reached", self.system, n, n, "count",
                         note=f"stopped: {self.reason}; {self.wall_s:.0f} s{cap_note}"
                              + (f"; waited for ksmd {self.settles}× at the memory floor" if self.settles else ""))]
        if self.latencies:
            out.append(row("scale: create, first step", self.system, self.latencies[0],
                           note=f"{unit_name} 1-{len(self.latencies[0])}"))
            out.append(row("scale: create, last step", self.system, self.latencies[-1],
                           note=f"{unit_name} {n - len(self.latencies[-1]) + 1}-{n}"))
        return out


def each_row(metric: str, system: str, base: Mapping[str, int], mem: Mapping[str, int], n: int, note: str) -> Row:
    """MemAvailable's drop from ``base`` to ``mem`` ÷ ``n``, in MB; the growth of ``free``'s used beside it."""
    used = (used_kb(mem) - used_kb(base)) / 1024 / max(n, 1)
    return value_row(metric, system, (base["MemAvailable"] - mem["MemAvailable"]) / 1024 / max(n, 1), n, "MB",
                     note=f"{note}; `free`'s used grew {used:.1f} MB each")


def over(values: list[float], limit: float) -> str:
    """How many of ``values`` exceed ``limit`` (a target), for a row's note: a median can hide a tail."""
    return f"{sum(v > limit for v in values)} of {len(values)} above {limit:g} MB"


def _in_threads(fn: Callable[[Any], float], items: list[Any], threads: int) -> list[float]:
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return list(pool.map(fn, items))


def _timed_pass(fn: Callable[[Any], float], items: list[Any], threads: int) -> list[float]:
    """``_in_threads`` with this process's garbage collector held off: with a thousand SDK sandboxes
    in it, a full collection stopped every client thread mid-command for ~100 ms (a probe of 400: 97 ms
    in the middle of the pass), a tail that was the bench's own, not the server's."""
    gc.collect()
    gc.disable()
    try:
        return _in_threads(fn, items, threads)
    finally:
        gc.enable()


def _settle() -> dict[str, int]:
    """meminfo once the last creates' transient memory has gone."""
    time.sleep(2.0)
    return meminfo()


def _merged_note(merged: tuple[float, int, float]) -> str:
    waited, scans, cpu = merged
    return f"after ksmd's next {scans} full scans ({waited:.0f} s; ksmd CPU {cpu:.1f} s)"


# ---- aenv ---------------------------------------------------------------------------------------------
def _sdk(srv: Server) -> dict[str, Any]:
    """The e2b SDK's keyword arguments for this scenario's own server (the bench's env names the other)."""
    from aenv.testing.server import API_KEY

    return {"api_url": srv.url, "sandbox_url": srv.url, "api_key": os.environ.get("E2B_API_KEY", API_KEY)}


def _kill(ids: list[str], kw: dict[str, Any], threads: int) -> None:
    from e2b import Sandbox

    def one(sid: str) -> float:
        with contextlib.suppress(Exception):
            Sandbox.kill(sid, **kw)
        return 0.0

    _in_threads(one, list(ids), threads)


def _idle(srv: Server, knobs: Knobs, rows: list[Row], notes: list[str]) -> Ramp:
    from e2b import Sandbox

    kw = _sdk(srv)
    sbxs: dict[str, Any] = {}

    def create(record: Callable[[str], None]) -> float:
        t0 = time.perf_counter()
        sbx = Sandbox.create("base", timeout=3600, **kw)
        ms = ms_since(t0)
        record(sbx.sandbox_id)
        sbxs[sbx.sandbox_id] = sbx
        sbx.commands.run("sleep infinity", background=True).disconnect()
        return ms

    ramp = Ramp("aenv-ns")
    try:
        ramp.run(create, knobs, knobs.cap, lambda: _server_probe(srv), settle=lambda: after_ksm(srv.url, knobs.ksm_wait))
        now = _settle()
        n = len(ramp.ids)
        start_rss = ramp.steps[0]["server_rss_mb"] if ramp.steps else 0.0
        rss, others, n_others = process_rss(srv.proc.pid)
        bare, full = ns_pss(srv.state_dir, ramp.ids)
        rows += ramp.rows("sandboxes")
        rows.append(ramp.memory_row("scale: host memory per idle sandbox", now,
                                    "MemAvailable drop ÷ count, right after the last create (server growth, "
                                    "kernel memory, slirp4netns included)"))
        rows.append(row("scale: PSS per idle sandbox, all its processes", ramp.system, full, unit="MB",
                        note=f"its cgroup, its reaper and its slirp4netns; {over(full, TARGET_PSS_MB)}"))
        rows.append(row("scale: PSS per idle sandbox", ramp.system, bare, unit="MB",
                        note="its cgroup and its reaper (as in density)"))
        rows.append(value_row("scale: server / engine RSS at the end", ramp.system, rss + others, 1, "MB",
                              note=f"aenv serve {rss:.0f} MB (after its first step {start_rss:.0f} MB) + "
                                   f"{n_others} helper processes {others:.0f} MB; per-sandbox reapers and slirps not"))
        merged = after_ksm(srv.url, knobs.ksm_wait)
        if merged is not None:
            rows.append(ramp.memory_row("scale: host memory per idle sandbox, KSM merged", meminfo(),
                                        _merged_note(merged)))
            merged_pss = ns_pss(srv.state_dir, ramp.ids)[1]
            rows.append(row("scale: PSS per idle sandbox, all its processes, KSM merged", ramp.system, merged_pss,
                            unit="MB", note=f"{_merged_note(merged)}; {over(merged_pss, TARGET_PSS_MB)}"))
        rested = _until_rested(srv.url, knobs.ksm_wait)
        runs = _timed_pass(lambda s: timed(lambda: s.commands.run("true")), list(sbxs.values()), knobs.threads)
        again = _timed_pass(lambda s: timed(lambda: s.commands.run("true")), list(sbxs.values()), knobs.threads)
        rows.append(row("scale: run `true` in each sandbox at the end", ramp.system, runs,
                        note=f"`commands.run(\"true\")` in every one of the {n}, {knobs.threads} at a time, "
                             f"after the KSM wait; {rested}; their first since merged: copy-on-write faults"))
        rows.append(row("scale: run `true` in each sandbox again", ramp.system, again,
                        note="right after the pass above, the same way"))
        notes.append(series_note(ramp.system, ramp.steps))
        return ramp
    finally:
        _kill(ramp.ids, kw, knobs.threads)


def _until_rested(url: str, most: float) -> str:
    """Wait (at most ``most`` s) until the server rests ksmd because merging settled (``ksm_rest``): the
    steady state of an idle fleet, in which the commands pass is measured. Says what it found."""
    import httpx

    def ksm() -> dict[str, Any]:
        got: dict[str, Any] = httpx.get(url + "/aenv/info", trust_env=False, timeout=30).json().get("ksm", {})
        return got

    if not ksm().get("rest"):
        return "ksmd not rested by this server (ksm_rest off or not merging)"
    t0 = time.monotonic()
    while not ksm().get("resting"):
        if time.monotonic() - t0 > most:
            return f"ksmd still scanning after {most:.0f} s more"
        time.sleep(2.0)
    return f"ksmd rested by the server ({time.monotonic() - t0:.0f} s more)"


def _server_probe(srv: Server) -> dict[str, Any]:
    import httpx

    rss, others, n_others = process_rss(srv.proc.pid)
    ksm: dict[str, Any] = {}
    with contextlib.suppress(httpx.HTTPError, ValueError):
        ksm = httpx.get(srv.url + "/aenv/info", trust_env=False, timeout=30).json().get("ksm", {})
    return {"server_rss_mb": round(rss, 1), "helpers_rss_mb": round(others, 1), "helpers": n_others,
            "ksm_pages_sharing": ksm.get("pagesSharing"), "ksm_pages_shared": ksm.get("pagesShared"),
            "ksm_full_scans": ksm.get("fullScans"), "tasks": tasks()}  # fmt: skip


def _forks(srv: Server, knobs: Knobs, rows: list[Row], notes: list[str]) -> list[dict[str, Any]]:
    """One parent holding 48 MiB, forked ``FORK_BATCH`` at a time into ``knobs.forks`` children."""
    from e2b import Sandbox

    from aenv.client import AenvClient

    kw = _sdk(srv)
    kids: list[str] = []
    parent = None
    series: list[dict[str, Any]] = []
    try:
        parent = Sandbox.create("base", timeout=3600, **kw)
        parent.commands.run(HOLD_48MIB, background=True).disconnect()
        time.sleep(3.0)  # the 48 MiB drawn from urandom and the command's stream gone
        base = _settle()
        calls: list[float] = []
        mode = None
        errors: list[str] = []
        with AenvClient(srv.url, kw["api_key"]) as client:
            while len(kids) < knobs.forks and not errors:
                t0 = time.perf_counter()
                res = client.fork(parent.sandbox_id, min(FORK_BATCH, knobs.forks - len(kids)), timeout=3600)
                calls.append(ms_since(t0))
                kids += res.sandbox_ids
                mode, errors = res.mode, res.errors
                point = step_record(len(kids), calls[-1:], meminfo(), base, 0.0)
                series.append({k: v for k, v in point.items() if not k.startswith(("create", "elapsed"))}
                              | {"fork_call_ms": round(calls[-1], 1)})
        now = _settle()
        n = len(kids)
        _, full = ns_pss(srv.state_dir, kids)
        _, parent_pss = ns_pss(srv.state_dir, [parent.sandbox_id])
        stop = f"; stopped at {n}: {errors[0][:200]}" if errors else ""
        rows.append(value_row("scale fork: children of one parent", "aenv-ns", n, n, "count",
                              note=f"mode {mode}; the parent's process holds 48 MiB of random bytes{stop}"))
        rows.append(row(f"scale fork: fork ×{FORK_BATCH} call", "aenv-ns", calls,
                        note=f"`POST /fork` of {FORK_BATCH} at a time (the last may be fewer)"))
        rows.append(each_row("scale fork: host memory per child", "aenv-ns", base, now, n,
                             "MemAvailable drop ÷ children, right after the last fork (the fork point the first "
                             "fork makes included; the parent not)"))
        rows.append(row("scale fork: PSS per child, all its processes", "aenv-ns", full, unit="MB",
                        note=f"the parent: {parent_pss[0]:.1f} MB; {over(full, TARGET_FORK_MB)}"))
        merged = after_ksm(srv.url, knobs.ksm_wait)
        if merged is not None:
            rows.append(each_row("scale fork: host memory per child, KSM merged", "aenv-ns", base, meminfo(), n,
                                 _merged_note(merged)))
            merged_pss = ns_pss(srv.state_dir, kids)[1]
            rows.append(row("scale fork: PSS per child, all its processes, KSM merged", "aenv-ns", merged_pss,
                            unit="MB", note=f"{_merged_note(merged)}; {over(merged_pss, TARGET_FORK_MB)}"))
        return series
    finally:
        _kill([*kids, *([parent.sandbox_id] if parent is not None else [])], kw, knobs.threads)


# ---- docker -------------------------------------------------------------------------------------------
def _docker(docker: DockerBaseline, knobs: Knobs, cap: int, capped: str, rows: list[Row]) -> Ramp:
    def create(record: Callable[[str], None]) -> float:
        t0 = time.perf_counter()
        cid = docker.start_idle()
        ms = ms_since(t0)
        record(cid)
        return ms

    def probe() -> dict[str, Any]:
        rss, others, n_others = process_rss(docker.proc.pid)
        return {"server_rss_mb": round(rss, 1), "helpers_rss_mb": round(others, 1), "helpers": n_others,
                "tasks": tasks()}

    ramp = Ramp("docker")
    try:
        ramp.run(create, knobs, cap, probe)
        now = _settle()
        n = len(ramp.ids)
        sample = spread(ramp.ids, 50)
        bare, shim = docker_pss(docker, sample)
        rss, others, _ = process_rss(docker.proc.pid)
        rows += ramp.rows("containers", capped)
        rows.append(ramp.memory_row("scale: host memory per idle sandbox", now,
                                    "MemAvailable drop ÷ count, right after the last `docker run -d` (dockerd, "
                                    "containerd and shims included)"))
        rows.append(row("scale: PSS per idle sandbox, all its processes", "docker", shim, unit="MB",
                        note=f"its cgroup + its containerd-shim; {len(sample)} of {n}, spread over the ramp"))
        rows.append(row("scale: PSS per idle sandbox", "docker", bare, unit="MB", note="its cgroup alone"))
        rows.append(value_row("scale: server / engine RSS at the end", "docker", rss + others, 1, "MB",
                              note=f"dockerd {rss:.0f} MB + its children (containerd) {others:.0f} MB"))
        execs = _timed_pass(lambda c: timed(lambda: docker.docker("exec", c, "true")), spread(ramp.ids, 100),
                            knobs.threads)
        rows.append(row("scale: run `true` in each sandbox at the end", "docker", execs,
                        note=f"`docker exec … true` in {len(execs)} of the {n}, {knobs.threads} at a time "
                             "(the CLI's start included)"))
        return ramp
    finally:
        for i in range(0, len(ramp.ids), 100):
            docker.remove(*ramp.ids[i : i + 100])


# ---- the scenario ---------------------------------------------------------------------------------------
def density_at_scale(ctx: Ctx) -> dict[str, Any]:
    """Idle sandboxes until half the host's memory or 2,000, fork children, beside idle docker containers."""
    from aenv.testing.server import start_server, stop_server

    if ctx.runtime != "ns":
        return scenario(TITLE, [], [f"{ctx.runtime}: scale runs on ns only (one QEMU per sandbox: see density)"])
    knobs = Knobs.from_env(ctx.smoke)
    rows: list[Row] = []
    notes = ["issue 35's targets: 1,000 idle sandboxes on one node answering `commands.run` with p99 ≤ 50 ms; "
             "≤ 8 MB PSS per idle ns sandbox; ≤ 4 MB per fork child",
             f"knobs: cap {knobs.cap}, step {knobs.step}, {knobs.threads} creates at once, {knobs.forks} fork "
             f"children, memory floor {knobs.floor:.0%} of MemTotal, KSM wait ≤ {knobs.ksm_wait:.0f} s "
             "(AENV_BENCH_SCALE_*); pid_max " + Path("/proc/sys/kernel/pid_max").read_text().strip()]
    series: dict[str, Any] = {}
    tmp = Path(tempfile.mkdtemp(prefix="aenv-bench-scale-"))
    # the bench's defaults (pool 4, ksm auto) and room for the cap, the children and the pool
    srv = start_server(tmp, "ns", {"AENV_POOL_SIZE": "4", "AENV_KSM": "auto",
                                   "AENV_MAX_SANDBOXES": str(knobs.cap + knobs.forks + 64)})
    try:
        _warm(srv)
        idle = _idle(srv, knobs, rows, notes)
        series["aenv-ns"] = idle.steps
        time.sleep(2.0)  # the killed sandboxes' memory back before the fork's baseline
        series["aenv-ns fork"] = _forks(srv, knobs, rows, notes)
    finally:
        stop_server(srv)  # anything left goes with it (stop_sandboxes_on_exit)
        if str(tmp) not in Path("/proc/mounts").read_text():
            shutil.rmtree(tmp, ignore_errors=True)
    if ctx.docker is not None:
        cap = min(len(idle.ids), knobs.docker_cap or len(idle.ids)) or 1
        capped = f"; capped at {cap}: " + ("AENV_BENCH_SCALE_DOCKER_MAX" if cap < len(idle.ids) else
                                            "the count aenv reached")
        ramp = _docker(ctx.docker, knobs, cap, capped, rows)
        series["docker"] = ramp.steps
        notes.append(series_note("docker", ramp.steps))
    else:
        notes.append("no docker baseline in this run")
    notes.append("one ramp after the other (aenv, its forks, then docker): the host's drift is not alternated "
                 "away; MemAvailable is host-wide, so anything else running moves it")
    out = scenario(TITLE, rows, notes)
    out["series"] = series
    return out


def _warm(srv: Server) -> None:
    """One create + command + kill on the fresh server: its warm pool is full before any baseline is read."""
    from e2b import Sandbox

    sbx = Sandbox.create("base", timeout=600, **_sdk(srv))
    sbx.commands.run("true")
    sbx.kill()
    time.sleep(3.0)

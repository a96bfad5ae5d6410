"""Density: proportional set size (PSS) of an idle sandbox, and how many idle sandboxes fit in 4 GiB;
where the server merges sandboxes (``ksm``), the same sandboxes again once ksmd has scanned them.

PSS charges each shared page to its sharers in equal parts, so summing it over every process of a
sandbox gives that sandbox's fair share of the machine's memory, shared template pages included.

* ns: the processes are the members of the sandbox's cgroup (``cgroup.procs`` of
  ``<hierarchy>/aenv/<scope>/<sandbox ID>``, see ``aenv.runtime.ns.cgroups``) and the reaper its
  launch left outside it;
* vm: the QEMU process whose pid the server recorded in its state database;
* docker: the members of the container's cgroup, and separately its ``containerd-shim``
  (the engine's daemons, shared by all containers, are not counted; neither is aenv's server).
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.context import Ctx
from bench.rows import row, scenario, value_row

if TYPE_CHECKING:
    from bench.baselines import DockerBaseline

BUDGET_MB = 4096.0


def pss_kb(pid: int) -> int:
    """``Pss:`` of ``/proc/<pid>/smaps_rollup`` in kB (0 if the process is gone)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return 0


def pss_mb(pids: list[int]) -> float:
    return sum(pss_kb(p) for p in pids) / 1024


REAPERS = ("reap", "unshare", "python3.11")  # what may stay behind outside an ns sandbox to reap its init


def ns_pids(state_dir: Path, sandbox_id: str) -> list[int]:
    """Every process of an ns sandbox, from its cgroup's ``cgroup.procs``, and the one the launch left
    behind outside it to reap the sandbox's init (``unshare --fork``, or in a user namespace the
    bundle's ``reap``; the server, a restored tree's parent, is not counted)."""
    from aenv.runtime.ns import cgroups

    cg = cgroups.Cgroup(cgroups.detect(None, cgroups.scope_for(state_dir)), sandbox_id)
    if not cg.exists():
        raise RuntimeError(f"no cgroup for sandbox {sandbox_id} under scope of {state_dir}")
    members = cg.pids()
    outside: set[int] = set()
    for pid in members:
        with contextlib.suppress(OSError, ValueError):
            parent = ppid(pid)
            comm = Path(f"/proc/{parent}/comm").read_text().strip()
            if parent in members or parent == 1 or comm not in REAPERS:
                continue
            if comm != "python3.11" or "import launch" in Path(f"/proc/{parent}/cmdline").read_text():
                outside.add(parent)  # an interpreter only if it is the launcher, never the server
    return [*members, *sorted(outside)]


def vm_pids(state_dir: Path, sandbox_id: str) -> list[int]:
    """The QEMU process of a vm sandbox, as recorded by the server (read-only look at its database)."""
    db = sqlite3.connect(f"file:{state_dir / 'aenv.db'}?mode=ro", uri=True, timeout=5)
    try:
        got = db.execute("SELECT runtime_state FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
    finally:
        db.close()
    if got is None:
        raise RuntimeError(f"sandbox {sandbox_id} not in {state_dir / 'aenv.db'}")
    pid = json.loads(got[0]).get("pid")
    return [int(pid)] if pid else []


def cgroup_pids_of(pid: int) -> list[int]:
    """Members of the (v1 memory, else v2) cgroup ``pid`` lives in."""
    memory_path = None
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        if "memory" in ctrls.split(","):
            memory_path = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
        elif ctrls == "" and memory_path is None:
            memory_path = Path("/sys/fs/cgroup") / path.lstrip("/")
    if memory_path is None:
        return [pid]
    return [int(x) for x in (memory_path / "cgroup.procs").read_text().split()]


def docker_pss(docker: DockerBaseline, cids: list[str]) -> tuple[list[float], list[float]]:
    """PSS (MB) of each container's cgroup, and of the same plus its ``containerd-shim`` (the parent of
    the container's init): what one more container costs beyond the engine's shared daemons."""
    inits = [docker.init_pid(c) for c in cids]
    return [pss_mb(cgroup_pids_of(p)) for p in inits], [pss_mb(cgroup_pids_of(p)) + pss_mb([ppid(p)]) for p in inits]


def ppid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def after_ksm(url: str, max_wait: float) -> tuple[float, int, float] | None:
    """When the server at ``url`` merges sandboxes (``/aenv/info`` ksm): wait until they are marked
    (its ``ksm_idle_s``) and for ksmd's next three full scans (the one under way passes newly marked
    processes by, the next notes their pages, the third merges what they share only with each other:
    ``runtime/ksm_rest.py``), or until the server rests ksmd because merging settled (``ksm_rest``: after three such
    scans of its own), at most ``max_wait`` s, and say how long it took, how many scans ran and ksmd's
    CPU time meanwhile. None when the server does not merge or the host has no ksmd running."""
    import httpx

    from aenv.runtime import ksm, ksm_rest

    key = os.environ.get("E2B_API_KEY", "")

    def info() -> dict[str, Any]:
        got: dict[str, Any] = httpx.get(url + "/aenv/info", headers={"X-API-KEY": key}, trust_env=False).json()
        ksm_info: dict[str, Any] = got.get("ksm", {})
        return ksm_info

    now = info()
    if not now.get("merge") or not (now.get("running") or now.get("resting")):
        return None
    # sandboxes are marked mergeable only once idle this long (ksm_idle_s); then ksmd may merge them. And
    # a server sees new sandboxes (and wakes a resting ksmd) at its next metrics round (5 s)
    time.sleep(float(now.get("mergeIdleS") or 0.0) + 0.5 + (5.0 if now.get("rest") else 0.0))
    now = info()
    rests0 = int(now.get("rests") or 0)
    scans0, cpu0, t0 = _full_scans(), ksm.ksmd_cpu_seconds() or 0.0, time.monotonic()
    if now.get("resting"):  # settled already: the server rested it after scans of its own
        return 0.0, 0, 0.0
    deadline = t0 + max_wait
    while _full_scans() < scans0 + ksm_rest.LEAST_SCANS and time.monotonic() < deadline:
        time.sleep(0.5)
        if int(info().get("rests") or 0) > rests0:
            break
    return time.monotonic() - t0, _full_scans() - scans0, (ksm.ksmd_cpu_seconds() or 0.0) - cpu0


def _unmerged(ctx: Ctx, count: int) -> list[float]:
    """PSS of ``count`` idle sandboxes of a second server of this checkout whose ``ksm`` is off: the
    baseline of the merged figures, in the same run (ksmd runs host-wide, so only unmarked processes
    show what a sandbox costs without it)."""
    import shutil
    import tempfile

    from e2b import Sandbox

    from aenv.testing.server import start_server, stop_server

    tmp = Path(tempfile.mkdtemp(prefix="aenv-bench-ksm-off-"))
    srv = start_server(tmp, ctx.runtime, {"AENV_KSM": "off", "AENV_POOL_SIZE": "2"})
    try:
        sbxs = [Sandbox.create("base", timeout=600, api_url=srv.url, sandbox_url=srv.url) for _ in range(count)]
        for sbx in sbxs:
            sbx.commands.run("true")
        time.sleep(2.0)
        return [pss_mb(ns_pids(srv.state_dir, sbx.sandbox_id)) for sbx in sbxs]
    finally:
        stop_server(srv)  # its sandboxes go with it (stop_sandboxes_on_exit)
        if str(tmp) not in Path("/proc/mounts").read_text():
            shutil.rmtree(tmp, ignore_errors=True)


GIVE_BACK_MB = 128


def given_back(ctx: Ctx, sbx: Any) -> list[dict[str, Any]]:
    """vm: what the host gets back when a guest frees memory. The guest fills ``GIVE_BACK_MB`` of
    tmpfs and deletes it; its balloon's free-page reporting hands freed 2 MiB blocks to QEMU, which
    drops them. QEMU's PSS idle, right after the delete, and once reporting has run (it waits ~2 s)."""
    assert ctx.state_dir is not None
    pids = vm_pids(ctx.state_dir, sbx.sandbox_id)
    idle = pss_mb(pids)
    sbx.commands.run(f"dd if=/dev/zero of=/dev/shm/fill bs=1M count={GIVE_BACK_MB} 2>/dev/null; sync", timeout=300)
    filled = pss_mb(pids)
    sbx.commands.run("rm -f /dev/shm/fill", timeout=60)
    freed = pss_mb(pids)
    time.sleep(1.0 if ctx.smoke else 8.0)
    reported = pss_mb(pids)
    note = f"one idle vm; the guest writes {GIVE_BACK_MB} MB to /dev/shm, then deletes it (balloon free-page reporting)"
    return [value_row("vm memory given back: QEMU PSS idle", ctx.system, idle, 1, "MB", note=note),
            value_row("vm memory given back: QEMU PSS, guest filled", ctx.system, filled, 1, "MB", note=note),
            value_row("vm memory given back: QEMU PSS, right after the delete", ctx.system, freed, 1, "MB", note=note),
            value_row("vm memory given back: QEMU PSS, after reporting", ctx.system, reported, 1, "MB",
                      note=f"{1.0 if ctx.smoke else 8.0:.0f} s after the delete: {filled - reported:.0f} MB of the "
                           f"{filled - idle:.0f} MB the fill took came back")]


def _full_scans() -> int:
    return int(Path("/sys/kernel/mm/ksm/full_scans").read_text())


def density(ctx: Ctx) -> dict[str, Any]:
    """PSS per idle sandbox and idle sandboxes per 4 GiB vs idle docker containers."""
    from e2b import Sandbox

    if ctx.state_dir is None:
        raise RuntimeError("density needs the server's state dir: let the bench start the server, "
                           "or set AENV_STATE_DIR to the one --server uses")
    count = ctx.n(2, 10, vm=6)
    finder = ns_pids if ctx.runtime == "ns" else vm_pids
    sbxs: list[Any] = []
    cids: list[str] = []
    try:
        for _ in range(count):
            sbx = Sandbox.create("base", timeout=600)
            sbx.commands.run("true")
            sbxs.append(sbx)
        if ctx.docker is not None:
            cids = [ctx.docker.start_idle() for _ in range(count)]
        time.sleep(2.0)  # let the last command's transient state go; idle is what we measure
        ours = [pss_mb(finder(ctx.state_dir, s.sandbox_id)) for s in sbxs]
        procs = [len(finder(ctx.state_dir, s.sandbox_id)) for s in sbxs]
        rows = [row("PSS per idle sandbox", ctx.system, ours, unit="MB",
                    note=f"processes per sandbox: {sorted(procs)[len(procs) // 2]} (median), its reaper outside the cgroup included; server not counted")]
        per = rows[0]["p50"]
        rows.append(value_row("idle sandboxes in 4 GiB", ctx.system, BUDGET_MB / per, len(ours), "count",
                              note="4096 MB / median PSS"))
        merged = after_ksm(ctx.url, 15 if ctx.smoke else 120)
        if merged is not None and ctx.runtime == "ns":
            off = _unmerged(ctx, count)
            rows.append(row("PSS per idle sandbox", f"{ctx.system} ksm off", off, unit="MB",
                            note="the same count on a second server of this checkout with ksm = off, this run"))
        if merged is not None:
            waited, scans, cpu = merged
            after = [pss_mb(finder(ctx.state_dir, s.sandbox_id)) for s in sbxs]
            rows.append(row("PSS per idle sandbox, KSM merged", ctx.system, after, unit="MB",
                            note=f"the same sandboxes after ksmd's {scans} full scans ({waited:.0f} s; ksmd CPU "
                                 f"{cpu:.1f} s, {100 * cpu / max(waited, 0.1):.0f}% of one CPU); ksm policy on"))
            rows.append(value_row("idle sandboxes in 4 GiB, KSM merged", ctx.system, BUDGET_MB / rows[-1]["p50"],
                                  len(after), "count", note="4096 MB / median PSS after merging"))
        if ctx.runtime == "vm" and sbxs:
            rows += given_back(ctx, sbxs[0])
        if ctx.docker is not None:
            bare, shim = docker_pss(ctx.docker, cids)
            rows.append(row("PSS per idle sandbox", "docker", bare, unit="MB",
                            note="container's cgroup (`sleep infinity`)"))
            rows.append(row("PSS per idle sandbox + shim", "docker", shim, unit="MB",
                            note="+ its containerd-shim; dockerd/containerd not counted"))
            rows.append(value_row("idle sandboxes in 4 GiB", "docker", BUDGET_MB / rows[-1]["p50"], len(shim),
                                  "count", note="4096 MB / median PSS incl. shim"))
        return scenario(f"density: {count} idle sandboxes side by side", rows)
    finally:
        for s in sbxs:
            with contextlib.suppress(Exception):
                s.kill()
        if ctx.docker is not None:
            ctx.docker.remove(*cids)

"""Density: proportional set size (PSS) of an idle sandbox, and how many idle sandboxes fit in 4 GiB.

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
import sqlite3
import time
from pathlib import Path
from typing import Any

from bench.context import Ctx
from bench.rows import row, scenario, value_row

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


def ppid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


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
        if ctx.docker is not None:
            inits = [ctx.docker.init_pid(c) for c in cids]
            bare = [pss_mb(cgroup_pids_of(p)) for p in inits]
            shim = [pss_mb(cgroup_pids_of(p)) + pss_mb([ppid(p)]) for p in inits]
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

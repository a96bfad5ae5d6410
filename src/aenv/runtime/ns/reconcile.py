"""Start-up reconciliation: remove whatever the ns runtime left behind that nobody knows about.

Sources of truth, all findable without the store:

* ``<sandboxes_dir>/<id>/ns/ns.json`` - one per sandbox handed out (pid + start time, cgroup, slirp);
* ``<pool_dir>/<pool-id>/ns.json``    - pooled sandboxes of a previous server run (always orphans;
                                        the pool dir is ``<sandboxes_dir>/.ns-pool``, formerly
                                        ``<state>/ns-pool``);
* ``<hierarchy>/aenv/<name>``         - cgroups; their members are the sandbox's processes.

Anything whose name is not in ``known`` is killed (init + slirp by pid *and* start time, then every
member of its cgroup) and its cgroup and directory are removed. There are no host-side mounts or
veths to clean: mounts live in the sandbox's own mount namespace and slirp4netns uses a tap inside
the sandbox's netns. The sandboxes volume (``disk.py``) is not a leftover: it is mounted while a
server runs and ``NsRuntime.close`` unmounts it (sandboxes that outlive the server keep it alive in
their own mount namespaces); directories on it are removed with ``remove_tree`` (a quota subvolume
is dropped at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from aenv.runtime.network import kill_slirps_serving
from aenv.runtime.ns.cgroups import Cgroup, Layout, list_names
from aenv.runtime.ns.disk import remove_tree
from aenv.runtime.ns.paths import STATE_FILE
from aenv.runtime.ns.sandbox import NsSandbox

log = logging.getLogger("aenv.runtime.ns")


@dataclass
class ReconcileReport:
    killed: list[str] = field(default_factory=list)
    cgroups_removed: list[str] = field(default_factory=list)
    dirs_removed: list[str] = field(default_factory=list)


def _load(path: Path) -> dict[str, object] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


async def reconcile(layout: Layout, sandboxes_dir: Path, pool_dir: Path | Iterable[Path], known: set[str],
                    keep: set[str] | None = None) -> ReconcileReport:
    """Kill and remove every ns sandbox not in ``known`` (nor in ``keep``, e.g. the live pool).
    ``pool_dir`` may be several directories (the current pool dir and a legacy one)."""
    pool_dirs = [pool_dir] if isinstance(pool_dir, Path) else list(pool_dir)
    keep = set(keep or ()) | set(known)
    report = ReconcileReport()
    handled: set[str] = set()

    candidates: list[tuple[Path, Path]] = []  # (state file, dir to remove)
    if sandboxes_dir.is_dir():
        for d in sandboxes_dir.iterdir():
            # only directories the ns runtime made (another runtime's sandboxes are left alone)
            if d.is_dir() and not d.name.startswith(".") and d.name not in keep and (d / "ns").is_dir():
                candidates.append((d / "ns" / STATE_FILE, d))
    for pd in pool_dirs:
        if pd.is_dir():
            for d in pd.iterdir():
                if d.is_dir() and d.name not in keep:
                    candidates.append((d / STATE_FILE, d))

    served: set[int] = set()  # pids of the orphans' processes, to find slirps ns.json never recorded
    for state_file, top in candidates:
        data = _load(state_file)
        if data is not None and "cgroup" in data and "dir" in data:
            sbx = NsSandbox.from_state(layout, data)
            if sbx.name in keep:
                continue
            served.update(sbx.cgroup.pids())
            if sbx.init is not None:
                served.add(sbx.init.pid)
            if sbx.router is not None:
                served.add(sbx.router.pid)
            await sbx.aclose(remove_dir=top)
            handled.add(sbx.cgroup.name)
            report.killed.append(sbx.name)
        await asyncio.to_thread(remove_tree, top)
        report.dirs_removed.append(str(top))

    for name in sorted(list_names(layout) - keep - handled):
        cg = Cgroup(layout, name)
        served.update(cg.pids())
        with contextlib.suppress(Exception):
            await asyncio.to_thread(cg.kill_all)
            await asyncio.to_thread(cg.remove)
            report.cgroups_removed.append(name)
    # A server killed between spawning slirp4netns and recording its pid leaves a slirp that outlives
    # its netns (it is outside the cgroup and does not exit with the sandbox): find it by its target.
    slirps = await asyncio.to_thread(kill_slirps_serving, served)
    if slirps:
        log.info("ns reconcile: killed unrecorded slirp4netns %s", slirps)
    if report.killed or report.cgroups_removed or report.dirs_removed:
        log.info("ns reconcile: killed=%s cgroups=%s dirs=%d", report.killed, report.cgroups_removed,
                 len(report.dirs_removed))
    return report

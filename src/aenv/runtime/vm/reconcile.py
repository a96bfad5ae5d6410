"""Start-up reconciliation for the vm runtime: re-attach what a previous server left running, remove
whatever under the run root nobody owns.

QEMUs outlive their server on purpose (``start_new_session``): a restart *adopts* each sandbox the
store still knows from its recorded ``RuntimeState`` (same pid through a pidfd, QMP reconnected,
the channel reconnected on first use), or, for one released to disk, finds its saved state in its
run dir. Sources of truth for the rest, all findable without the store:

* ``<run_root>/<name>/``           one per QEMU we started (sandbox, pool entry, template boot);
                                   a QEMU's command line names its run dir (its sockets are there);
* ``<shm_dir>/sbx-<id>.mem``       RAM files of VMs restored from a full save;
* ``/dev/shm/aenv-*/.state-dir``   which state dir a template-RAM dir belongs to.

:func:`reconcile` kills every QEMU whose run dir no one keeps and removes the dir; RAM files of no
running sandbox go too. :func:`sweep_orphan_ram` drops template-RAM dirs whose state dir is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
from pathlib import Path

from aenv.runtime.base import RuntimeState, SandboxSpec
from aenv.runtime.process import ProcRef

from . import frozen
from .config import VmConfigError, config_from_json
from .machine import Machine, MachineError
from .release import is_released
from .sandbox import VmSandbox, run_paths
from .table import Released, VmTable

log = logging.getLogger("aenv.runtime.vm")

OWNER_FILE = ".state-dir"  # in a template-RAM dir: the state dir it belongs to
KILL_WAIT_S = 10.0  # how long reconcile waits for a killed QEMU to be gone


async def reconcile(run_root: Path, shm_dir: Path, keep: set[str], running: set[str]) -> dict[str, list[str]]:
    """Kill the QEMU processes of, and remove, every run dir under ``run_root`` not named in
    ``keep``; remove the own-RAM files of sandboxes not in ``running``."""
    report: dict[str, list[str]] = {"killed": [], "removed": []}
    procs = await asyncio.to_thread(qemu_cmdlines)
    for entry in sorted(run_root.iterdir()) if run_root.is_dir() else []:
        if entry.name in keep:
            continue
        marker = f"{entry}/".encode()
        owners = [ref for pid, cmdline in procs.items() if marker in cmdline and (ref := ProcRef.of(pid))]
        for ref in owners:
            ref.kill(signal.SIGKILL)
            report["killed"].append(f"{ref.pid} ({entry.name})")
        # a big guest takes a while to unmap: its dir goes only once nothing has it open
        for ref in owners:
            if not await ref.wait_gone_async(KILL_WAIT_S):
                log.error("vm reconcile: QEMU %d (%s) survived SIGKILL for %.0f s", ref.pid, entry.name, KILL_WAIT_S)
        await asyncio.to_thread(shutil.rmtree, entry, True)
        report["removed"].append(entry.name)
    for mem in shm_dir.glob("sbx-*.mem") if shm_dir.is_dir() else []:  # sandbox.own_ram_file
        if mem.name[4:-4] not in running:
            mem.unlink(missing_ok=True)
            report["removed"].append(mem.name)
    if report["killed"] or report["removed"]:
        log.warning("vm reconcile: killed %s, removed %s", report["killed"], report["removed"])
    return report


async def adopt(table: VmTable, sandbox_id: str, spec: SandboxSpec, state: RuntimeState) -> VmSandbox | Released | None:
    """Re-attach to a VM left running by a previous server, or take back one it released to disk;
    either goes into ``table``. None when it is gone (the caller then kills/cleans)."""
    data = state.data
    try:
        cfg = config_from_json(data["config"])
        pid = int(data["pid"])
        run_dir = Path(data["run_dir"])
    except (KeyError, TypeError, ValueError, VmConfigError) as exc:
        if "released" not in data:
            log.warning("sandbox %s: cannot adopt, bad state: %s", sandbox_id, exc)
            return None
        cfg, pid, run_dir = None, -1, Path(str(data.get("run_dir", "")))
    name, template_key = str(data.get("name", sandbox_id)), str(data.get("template_key", ""))
    if is_released(run_dir):
        # Released to disk (or killed after its state was complete): no process to attach.
        kill_recorded(state)
        rel = Released(name, run_dir, template_key, disk_generation(run_dir), spec.allow_internet)
        table.released[sandbox_id] = rel
        table.specs[sandbox_id] = spec
        return rel
    if cfg is None:
        return None
    try:
        machine = await Machine.attach(cfg, pid, stderr_path=run_paths(run_dir)["stderr"])
    except MachineError as exc:
        log.warning("sandbox %s: cannot adopt: %s", sandbox_id, exc)
        return None
    sbx = VmSandbox(name, machine, run_dir, template_key)
    sbx.restored = True
    if data.get("base_ram") and data.get("ram_image"):
        sbx.base_ram, sbx.ram_image = Path(data["base_ram"]), Path(data["ram_image"])
        sbx.mem_chain = [Path(p) for p in data.get("mem_chain") or []]
    # Disk checkpoints of earlier snapshots stacked root.N.qcow2 overlays; QEMU writes the top one.
    sbx.disk_generation = disk_generation(run_dir)
    table.add(sandbox_id, sbx, spec)
    return sbx


def disk_generation(run_dir: Path) -> int:
    """Highest N of the root.N.qcow2 overlays that snapshots stacked in a run dir (0: none)."""
    gens = [int(p.name.split(".")[1]) for p in run_dir.glob("root.*.qcow2") if p.name.split(".")[1].isdigit()]
    return max(gens, default=0)


def kill_recorded(state: RuntimeState) -> None:
    """SIGKILL the QEMU a recorded state names, if that pid still is it (its command line names
    the recorded QMP socket): the store knew the sandbox, this server does not hold it."""
    pid, qmp = state.data.get("pid"), state.data.get("qmp")
    if not isinstance(pid, int) or not qmp:
        return
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return
    if str(qmp).encode() in cmdline:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def qemu_cmdlines() -> dict[int, bytes]:
    """pid → raw command line of every QEMU process we can see (reconcile, bench and test cleanup)."""
    out: dict[int, bytes] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if b"qemu-system" in cmd.split(b"\0", 1)[0]:
            out[int(d.name)] = cmd
    return out


def sweep_orphan_ram(shm_root: Path) -> list[Path]:
    """Remove template RAM dirs (``aenv-*`` in ``shm_root``) whose state dir no longer exists,
    e.g. after a test server's temporary state was deleted. RAM in tmpfs is the costly leak."""
    removed: list[Path] = []
    for d in shm_root.glob("aenv-*"):
        try:
            owner = Path((d / OWNER_FILE).read_text().strip())
        except OSError:
            continue
        if not owner.exists():
            frozen.remove_tree(d)
            removed.append(d)
    if removed:
        log.info("vm: removed template RAM of deleted state dirs: %s", [str(p) for p in removed])
    return removed

"""Files-only pause and cold boot: a VM that keeps only its disk, and comes back by booting on it.

A files-only pause (E2B's ``memory: false``) must leave nothing of the running guest but its files:
the guest flushes its filesystems (``sync`` through envd: a pause that cannot get that answer is
refused, the VM runs on), the vCPUs stop (QEMU drains and flushes the block layer), and QEMU ends
with its disk overlays kept and :data:`~.table.STOPPED_MARKER` written. A paused VM whose memory is
discarded (``resume(keep_memory=False)``, E2B's ``on_resume="reboot"``) is stopped the same way,
without the sync its stopped vCPUs cannot do: its disk is then as a power cut leaves it, which ext4's
journal makes consistent at the next mount.

The cold boot starts the template's kernel and initramfs on the sandbox's own disk chain (its
overlays on the template disk), in RAM of its own, exactly as the template's first boot did: init,
agent, envd and the template's start command run anew, the guest kernel picks a new boot id, and
``/init`` gives envd the sandbox's identity again. Under TCG that is a boot (seconds), not a restore.
The booted VM owns its RAM, so later snapshots and releases of it stream all of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from dataclasses import replace
from pathlib import Path

from aenv.errors import GuestUnresponsive
from aenv.runtime.base import RuntimeState, SandboxSpec
from aenv.runtime.envd_client import run_process

from .reconcile import disk_generation, qemu_cmdlines
from .release import is_released
from .sandbox import VmSandbox, child_config, own_ram_file, run_paths, spawn_on_own_ram
from .table import STOPPED_MARKER, Released, VmTable
from .template import TemplateCache, wait_ready
from .volumes import VolumeExports

log = logging.getLogger("aenv.runtime.vm")

SYNC_TIMEOUT = 30.0  # s for the guest's sync before a files-only pause is refused


def is_stopped(run_dir: Path) -> bool:
    return (run_dir / STOPPED_MARKER).is_file()


def disks(run_dir: Path) -> list[Path]:
    return list(run_dir.glob("root*.qcow2"))


def _mark_stopped(rel: Released) -> None:
    tmp = rel.stopped_marker.with_name(f".{STOPPED_MARKER}.tmp")
    tmp.write_text(json.dumps({"disk_generation": rel.disk_generation, "template_key": rel.template_key}))
    os.rename(tmp, rel.stopped_marker)
    for p in rel.files():  # memory saved by an earlier release: discarded
        p.unlink(missing_ok=True)


async def sync_guest(sbx: VmSandbox, token: str | None) -> None:
    """The guest writes every dirty page of its filesystems to its disk (``sync`` through envd)."""
    try:
        async with asyncio.timeout(SYNC_TIMEOUT):
            code = await run_process(await sbx.open_envd(), "/bin/sh", ["-c", "sync"], token=token)
    except Exception as exc:  # noqa: BLE001 - whatever stopped the answer, the guest did not sync
        raise GuestUnresponsive(f"sandbox {sbx.name}: the guest did not sync its disk ({exc!r}); it keeps running",
                                sandbox_id=sbx.name) from exc
    if code != 0:
        raise GuestUnresponsive(f"sandbox {sbx.name}: the guest's sync answered {code}; it keeps running",
                                sandbox_id=sbx.name)


async def stop_locked(table: VmTable, sandbox_id: str) -> Released:
    """Make the sandbox stopped (the caller holds its lock and cancelled any release timer): a
    running VM syncs and ends, a paused one ends, a released one's saved memory goes."""
    rel = table.released.get(sandbox_id)
    if rel is not None:
        if rel.memory:
            rel = replace(rel, memory=False)
            await asyncio.to_thread(_mark_stopped, rel)
            table.released[sandbox_id] = rel
        return rel
    sbx = table.get(sandbox_id)
    spec = table.specs.get(sandbox_id)
    if await sbx.machine.status() == "running":
        await sync_guest(sbx, spec.access_token if spec else None)
        await sbx.machine.pause()  # stop drains and flushes every drive: the overlays are complete
    rel = Released(sbx.name, sbx.run_dir, sbx.template_key, sbx.disk_generation,
                   spec.allow_internet if spec else sbx.machine.cfg.network == "user", memory=False)
    await asyncio.to_thread(_mark_stopped, rel)
    await sbx.drop_session()
    await sbx.machine.kill(keep=[*disks(sbx.run_dir), rel.stopped_marker])
    table.running.pop(sandbox_id, None)
    table.released[sandbox_id] = rel
    log.info("sandbox %s: stopped, its disk kept", sandbox_id)
    return rel


async def boot_locked(table: VmTable, templates: TemplateCache, sandbox_id: str, spec: SandboxSpec, *,
                      shm_dir: Path, pids_limit: int, timeout: float,
                      exports: VolumeExports | None = None) -> VmSandbox:
    """Boot a stopped sandbox on its disk and give envd its identity; it is running afterwards. On
    failure it stays stopped (its disk and marker are kept)."""
    rel = table.released[sandbox_id]
    tpl = await templates.by_key(rel.template_key)
    top = run_paths(rel.run_dir)["root"]
    if rel.disk_generation:
        top = top.with_name(f"root.{rel.disk_generation}.qcow2")
    share = await asyncio.to_thread(exports.prepare, spec) if exports is not None else None
    cfg = child_config(tpl.cfg, rel.name, rel.run_dir, spec.allow_internet, share)
    cfg = replace(cfg, incoming=False, start_paused=False,
                  drives=tuple(replace(d, path=top) if d.serial == "root" else d for d in cfg.drives))
    t0 = time.perf_counter()
    machine = await spawn_on_own_ram(cfg, own_ram_file(shm_dir, sandbox_id), rel.run_dir)
    sbx = VmSandbox(rel.name, machine, rel.run_dir, rel.template_key)
    sbx.disk_generation = rel.disk_generation
    sbx.volumes = spec.volumes if share is not None else ()
    try:
        await sbx.wait_envd(timeout)
        if spec.template.ready_cmd:
            await wait_ready(sbx, spec.template.ready_cmd, timeout)
        await sbx.init_envd(spec, pids_limit)
        await sbx.check_volumes(spec.access_token)
    except BaseException:
        await sbx.drop_session()
        await machine.kill(keep=[*disks(rel.run_dir), rel.stopped_marker])
        raise
    sbx.restored = True
    rel.stopped_marker.unlink(missing_ok=True)
    del table.released[sandbox_id]
    table.running[sandbox_id] = sbx
    log.info("sandbox %s: booted on its disk in %.1f s", sandbox_id, time.perf_counter() - t0)
    return sbx


def adopt_stopped(table: VmTable, sandbox_id: str, spec: SandboxSpec, state: RuntimeState) -> Released | None:
    """After a restart, a sandbox the store says is paused without memory, or was being stopped or
    booted: every QEMU of its run dir ends (the recorded one, or a boot in flight), saved memory
    goes, the disk stays. None when its disk is gone."""
    run_dir = Path(str(state.data.get("run_dir") or ""))
    if not run_dir.name or not disks(run_dir):
        return None
    marker = f"{run_dir}/".encode()
    for pid, cmdline in qemu_cmdlines().items():
        if marker in cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    name = str(state.data.get("name", sandbox_id))
    rel = Released(name, run_dir, str(state.data.get("template_key", "")), disk_generation(run_dir),
                   spec.allow_internet, memory=False)
    if not is_stopped(run_dir) or is_released(run_dir):
        _mark_stopped(rel)
    table.released[sandbox_id] = rel
    table.specs[sandbox_id] = spec
    return rel

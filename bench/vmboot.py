"""Baseline for the vm runtime: a plain QEMU cold boot of the same guest kernel, initramfs and root disk
the vm server's template booted from, until envd inside answers ``GET /health`` — what a VM platform
without snapshot restore pays per sandbox.

It reuses the server's built template (``<state>/vm/templates/<key>/``): a fresh qcow2 overlay on its
``base.qcow2`` per boot, own sockets and RAM file, everything removed afterwards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import tempfile
import time
from pathlib import Path

from aenv.runtime.vm import disk
from aenv.runtime.vm.config import Drive, VmConfig, config_from_json
from aenv.runtime.vm.machine import Machine
from aenv.runtime.vm.sandbox import VmSandbox, run_paths
from bench.density import pss_kb


class QemuColdBoot:
    name = "qemu cold boot"

    def __init__(self, state_dir: Path, timeout: float = 180.0) -> None:
        manifests = sorted((state_dir / "vm" / "templates").glob("*/manifest.json"))
        if not manifests:
            raise RuntimeError(f"no vm template built under {state_dir} yet (create one sandbox first)")
        self.tdir = manifests[0].parent
        self.cfg = config_from_json(json.loads(manifests[0].read_text())["config"])
        self.timeout = timeout
        self._n = 0

    def once(self) -> float:
        return asyncio.run(self.boot())[0]

    async def boot(self, idle_pss_after: float | None = None) -> tuple[float, int | None]:
        """(ms from QEMU exec until envd answers ``/health``, PSS kB of the QEMU after
        ``idle_pss_after`` s idle, or None when not asked)."""
        self._n += 1
        run = Path(tempfile.mkdtemp(prefix="aenv-qb-"))
        shm = Path(tempfile.mkdtemp(prefix="aenv-qb-", dir="/dev/shm"))
        p = run_paths(run)
        m: Machine | None = None
        try:
            root = await disk.create_overlay(self.tdir / "base.qcow2", run / "root.qcow2")
            drives = tuple(Drive(root, "root") if d.serial == "root" else d for d in self.cfg.drives)
            cfg: VmConfig = dataclasses.replace(
                self.cfg, name=f"bench-coldboot-{self._n}", qmp_socket=p["qmp"], channel_socket=p["chan"],
                serial_log=p["console"], mem_path=shm / "ram", mem_share=True, drives=drives,
                incoming=False, start_paused=False,
            )
            t0 = time.perf_counter()
            m = await Machine.spawn(cfg, stderr_path=p["stderr"], owned=[cfg.mem_path])
            sbx = VmSandbox(cfg.name, m, run, "bench")
            await sbx.wait_envd(self.timeout)
            took = (time.perf_counter() - t0) * 1000
            pss = None
            if idle_pss_after is not None:
                await asyncio.sleep(idle_pss_after)
                pss = pss_kb(m.pid)
            await sbx.drop_session()
            return took, pss
        finally:
            if m is not None:
                await m.kill()
            shutil.rmtree(run, ignore_errors=True)
            shutil.rmtree(shm, ignore_errors=True)

    def close(self) -> None:
        pass

"""Firecracker driver on a host with real KVM: boot the aenv mini kernel, snapshot, restore twice
from one memory file. Skipped with the reason where Firecracker cannot run guests (no binary in
``AENV_FIRECRACKER``, or ``/dev/kvm`` without ``kvm_intel``/``kvm_amd``, as on KVM-PVM hosts)."""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path

import pytest

from aenv.config import default_cache_dir
from aenv.runtime.vm.firecracker import FirecrackerConfig, FirecrackerVm, unavailable_reason, vmlinux_for
from aenv.runtime.vm.kernel import find_kernel

BINARY = os.environ.get("AENV_FIRECRACKER")
_reason = unavailable_reason(BINARY)
_kernel = find_kernel(Path(os.environ.get("AENV_CACHE_DIR") or default_cache_dir()))
if _reason is None and _kernel is None:
    _reason = "guest kernel not built: python -m aenv.runtime.vm.kernel build"

pytestmark = [pytest.mark.vm, pytest.mark.skipif(_reason is not None, reason=f"firecracker: {_reason}")]


async def _running(vm: FirecrackerVm) -> str:
    import json

    status, body = await vm.api.request("GET", "/")
    assert status == 200, body
    return str(json.loads(body)["state"])


async def test_boot_snapshot_restore(tmp_path: Path) -> None:
    assert _kernel is not None and BINARY is not None
    run = Path("/tmp") / f"fc-{secrets.token_hex(4)}"
    run.mkdir()
    vms: list[FirecrackerVm] = []
    try:
        cfg = FirecrackerConfig(
            name="fc-test", binary=BINARY, kernel=vmlinux_for(_kernel), api_socket=run / "a.sock",
            boot_args="console=ttyS0 panic=-1 reboot=k", memory_mb=128, log_path=run / "log",
        )  # fmt: skip
        vm = await FirecrackerVm.boot(cfg)
        vms.append(vm)
        await asyncio.sleep(1.0)
        assert await _running(vm) == "Running"
        await vm.snapshot(run / "state", run / "mem")
        await vm.kill()
        for i in range(2):
            child = await FirecrackerVm.restore(
                FirecrackerConfig(name=f"fc-{i}", binary=BINARY, kernel=cfg.kernel, api_socket=run / f"r{i}.sock"),
                run / "state", run / "mem",
            )  # fmt: skip
            vms.append(child)
            assert await _running(child) == "Running"
            print(f"restore {i}: {child.timings['restore_ms']:.1f} ms")
    finally:
        for v in vms:
            await v.kill()
        for p in run.iterdir():
            p.unlink()
        run.rmdir()

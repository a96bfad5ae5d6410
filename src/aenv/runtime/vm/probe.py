"""Boot probe: does an ordinary guest actually run under an accelerator here?

``/dev/kvm`` can exist and still be useless for our kernel (KVM-PVM emulates it to death, see
notes/vmm.md). The only robust test is to boot the real guest kernel with the test-shell initramfs
and wait for its answer on the virtio-serial port, with a timeout. Costs ~1.5 s under TCG, less
under KVM; run it once at start-up or from ``aenv doctor``, not per sandbox.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .config import Accel, VmConfig
from .initramfs import build as build_initramfs
from .machine import Machine, MachineError
from .shellchan import ShellChannel


@dataclass(frozen=True)
class ProbeResult:
    accel: Accel
    ok: bool
    seconds: float
    detail: str


async def boot_probe(
    kernel: Path,
    accel: Accel,
    cache_dir: Path,
    tsc_khz: int | None = None,
    timeout: float = 20.0,
) -> ProbeResult:
    """Boot ``kernel`` under ``accel`` until the guest shell answers ``echo ok`` or ``timeout``."""
    initrd = await asyncio.to_thread(build_initramfs, cache_dir, ["/bin/sh"])
    run = Path(tempfile.mkdtemp(prefix="aenv-probe-"))
    shm = Path(tempfile.mkdtemp(prefix="aenv-probe-", dir="/dev/shm"))
    cfg = VmConfig(
        name="aenv-probe",
        kernel=kernel,
        initrd=initrd,
        qmp_socket=run / "qmp.sock",
        channel_socket=run / "chan.sock",
        serial_log=run / "console.log",
        mem_path=shm / "ram",
        memory_mb=128,
        accel=accel,
        tsc_khz=tsc_khz,
        network="none",
        balloon=False,
        append=("aenv.init=shell",),
    )
    t0 = time.perf_counter()
    m: Machine | None = None
    try:
        async with asyncio.timeout(timeout):
            m = await Machine.spawn(cfg, stderr_path=run / "stderr", owned=[cfg.mem_path])
            reader, writer = await m.open_channel()
            ch = ShellChannel(reader, writer)
            try:
                rc, out = await ch.run("echo ok", timeout=timeout)
            finally:
                await ch.aclose()
        ok = (rc, out) == (0, "ok")
        return ProbeResult(
            accel, ok, time.perf_counter() - t0, "guest answered" if ok else f"reply {rc} {out!r}"
        )
    except (TimeoutError, MachineError, OSError) as exc:
        detail = "no answer within timeout" if isinstance(exc, TimeoutError) else str(exc)
        return ProbeResult(accel, False, time.perf_counter() - t0, detail)
    finally:
        if m is not None:
            await m.kill()
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)

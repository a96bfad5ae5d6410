"""Pool entries run at a low CPU priority until handed out: every thread of the process, not just
its main one (Linux nice is per thread, and QEMU's vCPUs are threads)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aenv.runtime.vm.machine import Machine

THREADS = "import threading, time\nfor _ in range(3): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\ntime.sleep(60)\n"


def _nices(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        out.append(int(stat.rsplit(")", 1)[1].split()[16]))  # field 19: nice
    return out


@pytest.mark.skipif(os.geteuid() != 0, reason="raising the priority back needs CAP_SYS_NICE (root)")
def test_set_nice_reaches_every_thread() -> None:
    proc = subprocess.Popen([sys.executable, "-c", THREADS])
    try:
        for _ in range(100):
            if len(os.listdir(f"/proc/{proc.pid}/task")) >= 4:
                break
            time.sleep(0.02)
        machine = Machine.__new__(Machine)
        machine.proc = proc  # type: ignore[assignment]
        machine.set_nice(10)
        assert _nices(proc.pid) == [10] * 4
        machine.set_nice(0)
        assert _nices(proc.pid) == [0] * 4
    finally:
        proc.kill()
        proc.wait()
    machine.set_nice(5)  # gone: no error

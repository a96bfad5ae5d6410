"""vm runtime bench, standalone: ``run(smoke) -> dict``, or ``python -m bench.vm [--smoke]``.

Measured in one run, each beside a plain QEMU cold boot of the same kernel, initramfs and root disk
(the server's template, booted without snapshot restore until envd answers ``/health``):

* create → first ``commands.run("true")``, from the warm pool (pool_size 1, refilled between
  samples) and cold (a second server on the same state dir with pool_size 0: spawn + restore);
* ``commands.run("true")`` round trip on one sandbox;
* PSS per idle sandbox: ``Pss`` of ``/proc/<qemu pid>/smaps_rollup`` (guest RAM shared with the
  template file counts proportionally), against the PSS of one idle cold-booted QEMU.

Every QEMU it starts is killed and the servers' state (template RAM in /dev/shm included) removed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aenv.testing.server import API_KEY, Server, discard_vm_state, start_server, stop_server
from bench.density import pss_kb, vm_pids


def _stats(samples: list[float]) -> dict[str, Any]:
    s = sorted(samples)
    return {
        "n": len(s),
        "median": round(statistics.median(s), 1) if s else None,
        "min": round(s[0], 1) if s else None,
        "max": round(s[-1], 1) if s else None,
        "samples": [round(x, 1) for x in s],
    }


def _sdk_env(srv: Server) -> None:
    os.environ.update(E2B_API_URL=srv.url, E2B_SANDBOX_URL=srv.url, E2B_API_KEY=API_KEY, NO_PROXY="127.0.0.1")


def _create_first_command(n: int, pause_between: float) -> list[float]:
    from e2b import Sandbox

    out = []
    for _ in range(n):
        time.sleep(pause_between)  # let the pool refill (warm) or the machine settle (cold)
        t0 = time.perf_counter()
        sbx = Sandbox.create("base", timeout=300)
        sbx.commands.run("true")
        out.append((time.perf_counter() - t0) * 1000)
        sbx.kill()
    return out


def _timed(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


async def _cold_boot(state_dir: Path, idle_pss_after: float | None) -> tuple[float, int | None]:
    """(ms from QEMU exec until envd answers, PSS kB after ``idle_pss_after`` s idle or None)."""
    from bench.vmboot import QemuColdBoot

    return await QemuColdBoot(state_dir, timeout=300).boot(idle_pss_after)


def run(smoke: bool) -> dict[str, Any]:
    """All vm measurements of one run, as a JSON-able dict (``results`` + ``meta``)."""
    from e2b import Sandbox

    n = 2 if smoke else 7
    idle_n = 2 if smoke else 4
    idle_wait = 3.0 if smoke else 10.0
    tmp = Path(tempfile.mkdtemp(prefix="aenv-bench-vm-"))
    state = tmp / "state"
    res: dict[str, Any] = {"meta": {"smoke": smoke, "loadavg_start": os.getloadavg()}, "results": {}}
    r = res["results"]
    srv: Server | None = None
    try:
        srv = start_server(tmp, "vm", extra_env={"AENV_POOL_SIZE": "1"})
        _sdk_env(srv)
        t0 = time.perf_counter()
        Sandbox.create("base", timeout=300).kill()  # builds the template snapshot
        res["meta"]["first_create_incl_template_build_ms"] = round((time.perf_counter() - t0) * 1000)

        r["create_first_command_warm_ms"] = _stats(_create_first_command(n, pause_between=4.0))
        sbx = Sandbox.create("base", timeout=300)
        sbx.commands.run("true")
        r["commands_run_true_ms"] = _stats(_timed(lambda: sbx.commands.run("true"), n * 5))
        sbx.kill()

        idle = [Sandbox.create("base", timeout=300) for _ in range(idle_n)]
        for s in idle:
            s.commands.run("true")
        time.sleep(idle_wait)
        pss = [sum(pss_kb(pid) for pid in vm_pids(state, s.sandbox_id)) / 1024 for s in idle]
        r["pss_per_idle_sandbox_mb"] = _stats(pss)
        for s in idle:
            s.kill()
        stop_server(srv)

        srv = start_server(tmp, "vm", extra_env={"AENV_POOL_SIZE": "0"})  # same state: template reused
        _sdk_env(srv)
        r["create_first_command_cold_ms"] = _stats(_create_first_command(n, pause_between=1.0))
        stop_server(srv)
        srv = None

        boots = [
            asyncio.run(_cold_boot(state, idle_wait if i == 0 else None)) for i in range(1 if smoke else 3)
        ]
        r["qemu_cold_boot_to_envd_ms"] = _stats([b[0] for b in boots])
        r["qemu_cold_boot_idle_pss_mb"] = round((boots[0][1] or 0) / 1024, 1)
        warm, cold = r["create_first_command_warm_ms"]["median"], r["create_first_command_cold_ms"]["median"]
        boot = r["qemu_cold_boot_to_envd_ms"]["median"]
        r["speedup_vs_cold_boot"] = {"warm": round(boot / warm, 1), "cold": round(boot / cold, 1)}
    finally:
        if srv is not None:
            stop_server(srv)
        discard_vm_state(state)
        shutil.rmtree(tmp, ignore_errors=True)
    res["meta"]["loadavg_end"] = os.getloadavg()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.vm", description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="few samples, for CI")
    args = ap.parse_args(argv)
    json.dump(run(args.smoke), sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

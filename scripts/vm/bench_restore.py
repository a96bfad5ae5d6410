"""Where does a VM sandbox's create time go? Builds (or reuses) a busybox template, then for N
sandboxes measures: QEMU spawn, device-state restore, first mux round trip (agent), first and
second envd /health, /init. Also a plain cold boot of the same guest to envd for comparison.

    PYTHONPATH=src .venv/bin/python scripts/vm/bench_restore.py [--n 5] [--state /tmp/aenv-bench]

Run as root on an otherwise idle machine; kills everything it starts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from aenv.config import Settings, default_cache_dir
from aenv.runtime.base import SandboxImage, SandboxSpec
from aenv.runtime.envd_client import init_payload
from aenv.runtime.vm.runtime import VmRuntime


def busybox_rootfs(dest: Path) -> Path:
    if (dest / "bin" / "busybox").exists():
        return dest
    for d in ("bin", "etc", "root", "home/user", "proc", "sys", "dev", "tmp"):
        (dest / d).mkdir(parents=True, exist_ok=True)
    os.chmod(dest / "tmp", 0o1777)
    shutil.copy2("/bin/busybox", dest / "bin" / "busybox")
    for name in subprocess.run(
        ["/bin/busybox", "--list"], capture_output=True, text=True, check=True
    ).stdout.split():
        if not (dest / "bin" / name).exists():
            (dest / "bin" / name).symlink_to("busybox")
    (dest / "etc" / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\n"
    )
    (dest / "etc" / "group").write_text("root:x:0:\nuser:x:1000:\n")
    return dest


def ms(t0: float, t1: float) -> float:
    return (t1 - t0) * 1000


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--state", type=Path, default=Path("/tmp/aenv-bench"))
    ap.add_argument("--cold-boot", action="store_true", help="also time a fresh template boot (tens of s)")
    args = ap.parse_args()
    rootfs = busybox_rootfs(args.state / "rootfs")
    settings = Settings(state_dir=args.state / "state", cache_dir=default_cache_dir(), pool_size=0)
    rt = VmRuntime(settings)
    tpl = SandboxImage("bench", rootfs)
    rows: list[dict[str, float]] = []
    try:
        spec0 = SandboxSpec("b0", tpl, args.state / "sbx" / "b0", memory_mb=256)
        t0 = time.perf_counter()
        vt = await rt.template_for(spec0)
        print(f"template ready in {time.perf_counter() - t0:.1f} s ({vt.key})")
        for i in range(args.n):
            sid = f"b{i}"
            t0 = time.perf_counter()
            sbx = await rt._spawn_restore(sid, vt.key, True)
            t1 = time.perf_counter()
            await sbx.machine.restore(vt.device_state)
            t2 = time.perf_counter()
            session = await sbx.session()
            await session.ping(timeout=30)
            t3 = time.perf_counter()
            await sbx.envd_request("GET", "/health")
            t4 = time.perf_counter()
            await sbx.envd_request("GET", "/health")
            t5 = time.perf_counter()
            payload = init_payload(SandboxSpec(sid, tpl, args.state / "sbx" / sid))
            await sbx.envd_request("POST", "/init", payload)
            t6 = time.perf_counter()
            await sbx.envd_request("GET", "/health")
            t7 = time.perf_counter()
            rows.append({
                "spawn": ms(t0, t1), "restore": ms(t1, t2), "mux ping": ms(t2, t3), "health#1": ms(t3, t4),
                "health#2": ms(t4, t5), "init": ms(t5, t6), "health#3": ms(t6, t7), "total": ms(t0, t7),
            })  # fmt: skip
            await sbx.aclose()
        for k in rows[0]:
            vals = [r[k] for r in rows]
            print(
                f"{k:>10}: median {statistics.median(vals):7.1f} ms  (min {min(vals):.1f}, max {max(vals):.1f})"
            )
        if args.cold_boot:
            vt.remove()
            rt.templates.clear()
            t0 = time.perf_counter()
            await rt.template_for(spec0)
            print(f"cold boot to envd + snapshot (same guest): {time.perf_counter() - t0:.1f} s")
    finally:
        await rt.close()
        await rt.reconcile(set())


if __name__ == "__main__":
    asyncio.run(main())

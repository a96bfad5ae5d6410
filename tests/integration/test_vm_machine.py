"""Real QEMU microVMs under the accelerator the probe picks (TCG here): boot the mini kernel with the
test-shell initramfs, snapshot, restore, fork. Prints timings (run with ``-s`` to see them).

Needs ``qemu-system-x86_64``, ``qemu-img``, ``mkfs.ext4``, busybox-static and the cached guest kernel
(``python -m aenv.runtime.vm.kernel build``); skipped with the reason otherwise. Every QEMU started
here is owned by a fixture that kills it.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import statistics
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path

import pytest
import pytest_asyncio

from aenv.runtime.vm import disk, initramfs
from aenv.runtime.vm.accel import choose_accel
from aenv.runtime.vm.config import Drive, VmConfig
from aenv.runtime.vm.kernel import find_kernel
from aenv.runtime.vm.machine import Machine
from aenv.runtime.vm.shellchan import ShellChannel

KERNEL = find_kernel() if shutil.which("dpkg-query") else None
_missing = [t for t in ("qemu-system-x86_64", "qemu-img", "mkfs.ext4") if shutil.which(t) is None]
if not initramfs.BUSYBOX.is_file():
    _missing.append("busybox-static")

pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(bool(_missing), reason=f"missing: {', '.join(_missing)}"),
    pytest.mark.skipif(
        KERNEL is None, reason="guest kernel not built: python -m aenv.runtime.vm.kernel build"
    ),
    pytest.mark.timeout(180),
]

MEM_MB = 256


class Lab:
    """Owns the files and machines of one test; ``aclose`` kills every machine and removes the dir."""

    def __init__(self, root: Path, shm: Path, initrd: Path, base: Path) -> None:
        self.root = root
        self.shm = shm
        self.initrd = initrd
        self.base = base
        self.accel = choose_accel()
        self.machines: list[Machine] = []
        self.channels: list[ShellChannel] = []

    def config(self, name: str, overlay: Path, mem: Path, **kw: object) -> VmConfig:
        assert KERNEL is not None
        run = self.root / name
        run.mkdir(exist_ok=True)
        return VmConfig(
            name=name,
            kernel=KERNEL,
            initrd=self.initrd,
            qmp_socket=run / "qmp.sock",
            channel_socket=run / "chan.sock",
            serial_log=run / "console.log",
            mem_path=mem,
            memory_mb=MEM_MB,
            accel=self.accel.accel,
            tsc_khz=self.accel.tsc_khz,
            drives=(Drive(overlay, "root"),),
            append=("aenv.init=shell",),
            **kw,  # type: ignore[arg-type]
        )

    async def overlay(self, name: str, backing: Path | None = None) -> Path:
        return await disk.create_overlay(backing or self.base, self.root / f"{name}.qcow2")

    async def spawn(self, cfg: VmConfig) -> Machine:
        m = await Machine.spawn(cfg, stderr_path=cfg.qmp_socket.parent / "qemu.stderr")
        self.machines.append(m)
        return m

    async def channel(self, m: Machine, timeout: float = 60.0) -> ShellChannel:
        """Connect and wait until the guest shell answers."""
        r, w = await m.open_channel()
        ch = ShellChannel(r, w)
        self.channels.append(ch)
        rc, out = await ch.run("echo pong", timeout=timeout)
        assert (rc, out) == (0, "pong"), self.console(m)
        return ch

    def console(self, m: Machine) -> str:
        log = m.cfg.serial_log
        return log.read_text(errors="replace")[-3000:] if log and log.exists() else "(no console)"

    async def aclose(self) -> None:
        for ch in self.channels:
            await ch.aclose()
        for m in self.machines:
            await m.kill()
        shutil.rmtree(self.shm, ignore_errors=True)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest_asyncio.fixture(loop_scope="function")
async def lab(tmp_path: Path) -> AsyncIterator[Lab]:
    src = tmp_path / "rootfs"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "marker").write_text("from-the-root-disk")
    raw = await disk.make_ext4(src, tmp_path / "base.raw", size_mb=64)
    base = await disk.to_qcow2(raw, tmp_path / "base.qcow2")
    initrd = initramfs.build(tmp_path / "cache", ["/bin/sh"])
    shm = Path("/dev/shm") / f"aenv-test-{secrets.token_hex(4)}"
    shm.mkdir()
    lab = Lab(tmp_path / "run", shm, initrd, base)
    lab.root.mkdir()
    try:
        yield lab
    finally:
        await lab.aclose()


async def _timed(coro: Awaitable[object]) -> float:
    t0 = time.perf_counter()
    await coro
    return (time.perf_counter() - t0) * 1000


async def test_cold_boot_answers_and_is_a_vm(lab: Lab) -> None:
    t0 = time.perf_counter()
    m = await lab.spawn(lab.config("boot", await lab.overlay("boot"), lab.shm / "boot.mem"))
    ch = await lab.channel(m)
    boot_ms = (time.perf_counter() - t0) * 1000
    print(
        f"\n[vm] accel={lab.accel.accel} ({lab.accel.reason}); spawn→QMP {m.timings.spawn_ms:.0f} ms; "
        f"cold boot→shell answer {boot_ms:.0f} ms"
    )
    assert await ch.run("cat /newroot/etc/marker") == (0, "from-the-root-disk")
    rc, kernel = await ch.run("uname -r")
    assert rc == 0 and kernel != os.uname().release
    rc, cpuinfo = await ch.run("grep -c hypervisor /proc/cpuinfo")
    assert rc == 0 and int(cpuinfo) >= 1
    rc, procs = await ch.run("ls /proc | grep -c '^[0-9]'")
    assert rc == 0 and int(procs) < 50  # the host's processes are invisible
    rc, devs = await ch.run("ls /dev")
    assert "vport1p1" in devs.split() and "hwrng" in devs.split() and "vda" in devs.split()
    rc, drivers = await ch.run("ls /sys/bus/virtio/drivers")
    for drv in ("virtio_balloon", "virtio_blk", "virtio_console", "virtio_net", "virtio_rng"):
        assert drv in drivers.split(), drivers
    rc, feats = await ch.run("cat /sys/bus/virtio/drivers/virtio_balloon/*/features")
    assert rc == 0 and feats[5] == "1", feats  # VIRTIO_BALLOON_F_REPORTING (bit 5) negotiated
    assert await ch.run("false") == (1, "")
    t = [await _timed(ch.run("true")) for _ in range(20)]
    print(f"[vm] shell round trip median {statistics.median(t):.2f} ms")
    assert await m.status() == "running"
    await m.pause()
    assert await m.status() == "paused"
    await m.resume()
    assert (await ch.run("echo back"))[1] == "back"


async def _http_server() -> tuple[asyncio.AbstractServer, int]:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readuntil(b"\r\n\r\n")
        w.write(b"HTTP/1.0 200 OK\r\nContent-Length: 5\r\n\r\nhello")
        await w.drain()
        w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.mark.parametrize("network", ["user", "restricted"])
async def test_network_modes(lab: Lab, network: str) -> None:
    """``user`` reaches the internet (a test host on a public address) but not the host's loopback
    through slirp's 10.0.2.2 (QEMU runs in a network namespace of its own: netjail.py);
    ``restricted`` reaches neither."""
    from tests.fixtures.nethost import public_host

    server, port = await _http_server()
    try:
        with public_host() as public:
            m = await lab.spawn(
                lab.config(
                    f"net-{network}", await lab.overlay(network), lab.shm / f"{network}.mem", network=network
                )
            )
            ch = await lab.channel(m)
            # (busybox 1.35 wget segfaults with -q -T; plain wget under busybox timeout is fine)
            rc, out = await ch.run(f"timeout 10 wget -O - {public.url} 2>/dev/null", timeout=30)
            if network == "user":
                assert (rc, out) == (0, public.body), out
            else:
                assert rc != 0 and public.body not in out
            rc, out = await ch.run(f"timeout 10 wget -O - http://10.0.2.2:{port}/ 2>/dev/null", timeout=30)
            assert rc != 0 and "hello" not in out, "the guest reached the host's loopback"
            rc, addr = await ch.run("ip -4 addr show eth0")
            assert "10.0.2.15" in addr
    finally:
        server.close()


async def test_kill_is_idempotent_and_cleans_up(lab: Lab) -> None:
    overlay = await lab.overlay("k")
    cfg = lab.config("k", overlay, lab.shm / "k.mem")
    m = await Machine.spawn(cfg, stderr_path=lab.root / "k.stderr", owned=[overlay, cfg.mem_path])
    lab.machines.append(m)
    pid = m.pid
    assert cfg.qmp_socket.exists() and cfg.mem_path.exists()
    await m.kill()
    await m.kill()
    assert not m.alive and m.proc.returncode is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    for p in (cfg.qmp_socket, cfg.channel_socket, overlay, cfg.mem_path, lab.root / "k.stderr"):
        assert not p.exists(), p


async def test_spawn_failure_reports_stderr(lab: Lab) -> None:
    cfg = lab.config("bad", lab.root / "does-not-exist.qcow2", lab.shm / "bad.mem")
    from aenv.runtime.vm.machine import MachineError

    with pytest.raises(MachineError) as ei:
        await lab.spawn(cfg)
    assert "does-not-exist" in str(ei.value)
    assert not cfg.qmp_socket.exists()


async def _boot_template(lab: Lab) -> tuple[VmConfig, Path, Path, ShellChannel, Machine]:
    tpl_overlay = await lab.overlay("tpl")
    tpl_mem = lab.shm / "tpl.mem"
    cfg = lab.config("tpl", tpl_overlay, tpl_mem)
    m = await lab.spawn(cfg)
    ch = await lab.channel(m)
    return cfg, tpl_overlay, tpl_mem, ch, m


async def test_snapshot_restore_and_fork(lab: Lab) -> None:
    cfg, tpl_overlay, tpl_mem, ch, tpl = await _boot_template(lab)
    token = secrets.token_hex(8)
    assert (await ch.run(f"echo {token} > /tmp/state && echo ok"))[1] == "ok"
    state = lab.root / "tpl.dev"
    snap_ms = await tpl.snapshot(state)
    size = state.stat().st_size
    print(f"\n[vm] snapshot (stop→completed, x-ignore-shared) {snap_ms:.1f} ms, device state {size} B")
    assert size < 1_000_000
    await ch.aclose()
    await tpl.kill()  # the RAM file is frozen from here on

    async def fork(i: int, prespawn: bool = False) -> tuple[Machine, ShellChannel, dict[str, float]]:
        t0 = time.perf_counter()
        ov = await lab.overlay(f"f{i}", backing=tpl_overlay)
        child_cfg = lab.config(f"f{i}", ov, tpl_mem).for_restore()
        assert child_cfg.shape() == cfg.shape()
        m = await lab.spawn(child_cfg)
        t_up = time.perf_counter()
        if prespawn:
            t0 = t_up
        await m.restore(state)
        t_resumed = time.perf_counter()
        c = await lab.channel(m, timeout=30)
        t_answer = time.perf_counter()
        return (
            m,
            c,
            {
                "up": (t_up - t0) * 1000,
                "resumed": (t_resumed - t0) * 1000,
                "answer": (t_answer - t0) * 1000,
            },
        )

    # one cold restore
    m0, c0, t = await fork(0)
    _rc, guest_now = await c0.run("date +%s")
    print(f"[vm] guest clock after restore: {int(guest_now) - int(time.time()):+d} s vs host (not corrected)")
    print(
        f"[vm] cold restore: overlay+QEMU up {t['up']:.0f} ms, resumed {t['resumed']:.0f} ms, "
        f"shell answers {t['answer']:.0f} ms"
    )
    assert await c0.run("cat /tmp/state") == (0, token)
    assert await c0.run("cat /newroot/etc/marker") == (0, "from-the-root-disk")

    # from a pre-spawned -incoming defer process: only restore → answer is on the critical path
    m1, c1, t = await fork(1, prespawn=True)
    print(f"[vm] pre-spawned restore: resumed {t['resumed']:.1f} ms, shell answers {t['answer']:.1f} ms")
    assert await c1.run("cat /tmp/state") == (0, token)

    # isolation between forks: RAM (tmpfs) and disk
    await c0.run("echo changed > /tmp/state; echo x > /newroot/only-in-f0; sync")
    assert await c1.run("cat /tmp/state") == (0, token)
    assert (await c1.run("test -e /newroot/only-in-f0"))[0] == 1
    for m in (m0, m1):
        await m.kill()

    # 4 forks at once from the same snapshot (MAP_PRIVATE over one frozen RAM file)
    t0 = time.perf_counter()
    forks = await asyncio.gather(*(fork(i) for i in range(2, 6)))
    all_ms = (time.perf_counter() - t0) * 1000
    per = sorted(f[2]["answer"] for f in forks)
    print(f"[vm] 4 forks all answering in {all_ms:.0f} ms (per fork {per[0]:.0f}..{per[-1]:.0f} ms)")
    for _, c, _ in forks:
        assert await c.run("cat /tmp/state") == (0, token)
    assert tpl_mem.stat().st_size == MEM_MB * 2**20


async def test_restore_rejects_wrong_process(lab: Lab) -> None:
    from aenv.runtime.vm.machine import MachineError

    m = await lab.spawn(lab.config("nr", await lab.overlay("nr"), lab.shm / "nr.mem", start_paused=True))
    with pytest.raises(MachineError):
        await m.restore(lab.root / "none.dev")
    fork_cfg = lab.config("nr2", await lab.overlay("nr2"), lab.shm / "nr.mem").for_restore()
    m2 = await lab.spawn(fork_cfg)
    with pytest.raises(MachineError):
        await m2.snapshot(lab.root / "x.dev")


async def test_fork_of_a_running_private_vm(lab: Lab) -> None:
    """A restored sandbox (private RAM) forked with a full save + disk checkpoint; children get
    fresh shared RAM files, so they could be snapshotted the fast way later."""
    _cfg, tpl_overlay, tpl_mem, ch, tpl = await _boot_template(lab)
    state = lab.root / "tpl.dev"
    await tpl.snapshot(state)
    await ch.aclose()
    await tpl.kill()
    src_overlay = await lab.overlay("src", backing=tpl_overlay)
    src = await lab.spawn(lab.config("src", src_overlay, tpl_mem).for_restore())
    await src.restore(state)
    sch = await lab.channel(src)
    token = secrets.token_hex(8)
    await sch.run(f"echo {token} > /tmp/state; echo {token} > /newroot/from-src")

    await src.pause()
    disk_ms = await src.checkpoint_disk("root", lab.root / "src-top.qcow2")
    full = lab.root / "src.full"
    save_ms = await src.save_full(full)
    await src.resume()
    print(
        f"\n[vm] fork of a private VM: disk checkpoint {disk_ms:.1f} ms, full save {save_ms:.0f} ms "
        f"({full.stat().st_size // 2**20} MiB)"
    )
    assert await sch.run("cat /tmp/state") == (0, token)  # the source goes on
    assert (await sch.run("echo after > /tmp/state; echo after > /newroot/from-src; sync"))[0] == 0
    assert await sch.run("cat /newroot/from-src") == (0, "after")  # its disk is writable again

    t0 = time.perf_counter()
    children = []
    for i in range(2):
        ov = await lab.overlay(f"c{i}", backing=src_overlay)  # the frozen image
        c_cfg = lab.config(f"c{i}", ov, lab.shm / f"c{i}.mem").for_restore(mem_share=True)
        m = await lab.spawn(c_cfg)
        await m.restore(full, ignore_shared=False)
        children.append(await lab.channel(m, timeout=30))
    print(
        f"[vm] 2 children restored from the full save and answering in {(time.perf_counter() - t0) * 1000:.0f} ms"
    )
    for c in children:
        assert await c.run("cat /tmp/state") == (0, token)
        assert await c.run("cat /newroot/from-src") == (0, token)

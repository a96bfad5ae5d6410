"""VmRuntime end to end with the real agent and envd from the tools bundle: template boot +
snapshot, create by restore (cold and from the pre-spawned pool), envd over the mux, pause/resume,
clean kill. Prints timings (``-s``).

Needs QEMU, qemu-img, mkfs.ext4, busybox-static, the cached guest kernel and root (for the tools
bundle and ext4 ownership); skipped with the reason otherwise. Every QEMU is reaped by the fixture.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from aenv.config import Settings, default_cache_dir
from aenv.runtime.base import SandboxImage, SandboxSpec
from aenv.runtime.envd_client import request
from aenv.runtime.process import proc_start_time
from aenv.runtime.tools import ensure_tools
from aenv.runtime.vm.frozen import is_frozen_store, remove_tree
from aenv.runtime.vm.kernel import find_kernel
from aenv.runtime.vm.runtime import VmRuntime
from tests.fixtures.envd import run_cmd
from tests.fixtures.runtime import fork_via

BUSYBOX = Path("/bin/busybox")
CACHE = Path(os.environ.get("AENV_CACHE_DIR") or default_cache_dir())
_missing = [t for t in ("qemu-system-x86_64", "qemu-img", "mkfs.ext4") if shutil.which(t) is None]
if not BUSYBOX.is_file():
    _missing.append("busybox-static")

pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(bool(_missing), reason=f"missing: {', '.join(_missing)}"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (tools bundle, rootfs ownership)"),
    pytest.mark.skipif(
        shutil.which("dpkg-query") is None or find_kernel(CACHE) is None,
        reason="guest kernel not built: python -m aenv.runtime.vm.kernel build",
    ),
    pytest.mark.timeout(600),
]


def _busybox_rootfs(dest: Path) -> Path:
    """/bin/busybox + applet links + passwd/group with root and user (uid 1000)."""
    for d in ("bin", "sbin", "etc", "root", "home/user", "proc", "sys", "dev", "tmp", "usr/bin"):
        (dest / d).mkdir(parents=True, exist_ok=True)
    os.chmod(dest / "tmp", 0o1777)
    shutil.copy2(BUSYBOX, dest / "bin" / "busybox")
    applets = subprocess.run(
        [str(BUSYBOX), "--list"], capture_output=True, text=True, check=True
    ).stdout.split()
    for name in applets:
        link = dest / "bin" / name
        if not link.exists():
            link.symlink_to("busybox")
    (dest / "etc" / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\n"
    )
    (dest / "etc" / "group").write_text("root:x:0:\nuser:x:1000:\n")
    os.chown(dest / "home" / "user", 1000, 1000)
    return dest


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, Path]]:
    """State dir, RAM dir and tools bundle shared by the tests of this module, so the template is
    built once (the second runtime finds it on disk: the restart path). The bundle is pinned
    because its key follows the in-sandbox sources, which may change while the tests run."""
    state = tmp_path_factory.mktemp("vmstate")
    shm = Path("/dev/shm") / f"aenv-test-{secrets.token_hex(4)}"
    tools = ensure_tools(Settings(state_dir=state, cache_dir=CACHE))
    yield state, shm, tools
    remove_tree(shm)


def _no_qemu_under(path: Path) -> None:
    out = subprocess.run(["pgrep", "-f", str(path)], capture_output=True, text=True, check=False).stdout
    assert not out.strip(), f"QEMU left running: {out}"


@pytest_asyncio.fixture(loop_scope="function")
async def make_runtime(shared: tuple[Path, Path, Path]) -> AsyncIterator[Callable[[], VmRuntime]]:
    made: list[VmRuntime] = []
    state, shm, tools = shared

    def make() -> VmRuntime:
        rt = VmRuntime(Settings(state_dir=state, cache_dir=CACHE, pool_size=1), shm_dir=shm, tools_dir=tools)
        assert len(str(rt.run_root)) <= 64
        made.append(rt)
        return rt

    try:
        yield make
    finally:
        for rt in made:
            for sid in list(rt.table.running):
                await rt.kill(sid)
            await rt.close()
        for rt in made:
            await rt.reconcile(set())
            _no_qemu_under(rt.run_root)


_ROOTFS: list[Path] = []


def _template(tmp_path: Path) -> SandboxImage:
    """The same rootfs path for every test (it is part of the template key)."""
    if not _ROOTFS:
        _ROOTFS.append(_busybox_rootfs(tmp_path / "rootfs"))
    return SandboxImage(
        "busybox",
        _ROOTFS[0],
        env={"FROM_TEMPLATE": "1"},
        start_cmd="echo $FROM_TEMPLATE > /tmp/started-by-template",
    )


def _spec(tmp_path: Path, sid: str, template: SandboxImage, **kw: object) -> SandboxSpec:
    return SandboxSpec(sandbox_id=sid, template=template, workdir=tmp_path / "sbx" / sid, memory_mb=256, **kw)  # type: ignore[arg-type]


async def _health(rt: VmRuntime, sid: str) -> int:
    stream = await rt.open_stream(sid, 49983)
    status, _ = await request(stream, "GET", "/health")
    return status


async def test_template_create_pause_kill(make_runtime: Callable[[], VmRuntime], tmp_path: Path) -> None:
    runtime = make_runtime()
    tpl = _template(tmp_path)
    spec = _spec(tmp_path, "sbx1", tpl, env_vars={"HELLO": "world"}, access_token=None)

    t0 = time.perf_counter()
    await runtime.start()
    t_start = time.perf_counter()
    vt = await runtime.template_for(spec)
    t_tpl = time.perf_counter()
    print(f"\n[vm-rt] start {t_start - t0:.1f} s (artifacts), template boot+snapshot {t_tpl - t_start:.1f} s")
    assert vt.complete()

    t0 = time.perf_counter()
    state = await runtime.create(spec)
    cold_ms = (time.perf_counter() - t0) * 1000
    assert await _health(runtime, "sbx1") in (200, 204)
    first_ms = (time.perf_counter() - t0) * 1000
    print(f"[vm-rt] cold create (restore + envd init) {cold_ms:.0f} ms; + first /health {first_ms:.0f} ms")
    print(f"[vm-rt]   {runtime.sandbox('sbx1').machine.timings}")
    for _ in range(3):
        t1 = time.perf_counter()
        await _health(runtime, "sbx1")
        print(f"[vm-rt]   /health over the mux {(time.perf_counter() - t1) * 1000:.1f} ms")
    assert state.data["pid"] > 0 and Path(state.data["qmp"]).exists()
    # the template's image env and start command reach the guest agent (its config disk)
    _, out, _ = await run_cmd(runtime, "sbx1", "echo $FROM_TEMPLATE; cat /tmp/started-by-template")
    assert out.split() == ["1", "1"], out
    # commands run in the guest's sandbox cgroup, under the server's pids limit (envd.limits)
    _, out, _ = await run_cmd(runtime, "sbx1", "cat /proc/self/cgroup /sys/fs/cgroup/sandbox/pids.max")
    assert out.split() == ["0::/sandbox", str(runtime.settings.pids_limit)], out
    assert "limits=pids:" in runtime.sandbox("sbx1").host_facts

    session = await runtime.sandbox("sbx1").session()
    await runtime.pause("sbx1")
    assert await runtime.sandbox("sbx1").machine.status() == "paused"
    await asyncio.sleep(3)  # the stopped guest's clock stands still meanwhile
    await runtime.resume("sbx1", state)
    # no request of its own: the kept session's new HELLO set the clock before this command ran
    _, out, _ = await run_cmd(runtime, "sbx1", "date +%s")
    assert abs(int(out) - time.time()) < 2, out
    assert await runtime.sandbox("sbx1").session() is session, "pause and resume keep the channel"

    sample = await runtime.metrics("sbx1")
    assert sample.mem_total == 256 * 2**20 and sample.mem_used > 0

    # the pool has pre-spawned a waiting QEMU meanwhile; the next create takes it
    for _ in range(200):
        if runtime.pool.names():
            break
        await asyncio.sleep(0.05)
    assert runtime.pool.names()
    t0 = time.perf_counter()
    await runtime.create(_spec(tmp_path, "sbx2", tpl, allow_internet=True))
    warm_ms = (time.perf_counter() - t0) * 1000
    assert await _health(runtime, "sbx2") in (200, 204)
    print(
        f"[vm-rt] warm create from pool {warm_ms:.0f} ms; first /health {(time.perf_counter() - t0) * 1000:.0f} ms"
    )
    print(f"[vm-rt]   {runtime.sandbox('sbx2').machine.timings}")

    pid = runtime.sandbox("sbx1").machine.pid
    run_dir = runtime.sandbox("sbx1").run_dir
    await runtime.kill("sbx1", state)
    await runtime.kill("sbx1", state)  # idempotent
    assert not run_dir.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_restart_adopts_running_and_reconciles_orphans(
    make_runtime: Callable[[], VmRuntime], tmp_path: Path
) -> None:
    old = make_runtime()
    tpl = _template(tmp_path)
    t0 = time.perf_counter()
    s_keep = await old.create(_spec(tmp_path, "keep", tpl))
    await old.create(_spec(tmp_path, "orphan", tpl))
    print(f"\n[vm-rt] two creates (template from disk) {(time.perf_counter() - t0) * 1000:.0f} ms")
    # "crash": the old server's objects vanish without killing anything. Their slirp4netns children are
    # still this process's: reaped at the end, or their Popen objects would be collected unreaped (a
    # ResourceWarning, an error here) whenever the event loop did not get to their exit in time.
    old_slirps = [s.machine.slirp.child for s in old.table.running.values()
                  if s.machine.slirp is not None and s.machine.slirp.child is not None]
    for sbx in old.table.running.values():
        await sbx.drop_session()
        await sbx.machine.qmp.disconnect()
    orphan_pid = old.sandbox("orphan").machine.pid
    old.table.running.clear()
    await old.pool.aclose()

    new = make_runtime()
    assert await new.adopt("keep", _spec(tmp_path, "keep", tpl), s_keep)
    assert await _health(new, "keep") in (200, 204)
    await new.pause("keep")
    assert await new.sandbox("keep").machine.status() == "paused"
    await new.resume("keep", s_keep)
    report = await new.reconcile({"keep"})
    assert any(str(orphan_pid) in k for k in report["killed"])
    assert proc_start_time(orphan_pid) is None  # reconcile waits until it is gone (a zombie counts)
    assert await _health(new, "keep") in (200, 204)
    await new.kill("keep", s_keep)
    assert not Path(s_keep.data["run_dir"]).exists()
    assert await new.adopt("keep", _spec(tmp_path, "keep", tpl), s_keep) is False
    for child in old_slirps:  # both exited with their QEMUs (exit fd): reap them
        await child.aclose()


async def test_snapshot_fork_rollback(make_runtime: Callable[[], VmRuntime], tmp_path: Path) -> None:
    """Layered snapshots (device state + changed pages over the template's frozen RAM): the
    guest's RAM (a tmpfs file, a sleeping process) comes back in a fork and after a rollback;
    the source keeps running; a child can be snapshotted again; the base RAM is stored once."""
    from aenv.runtime.base import UNFINISHED_MARKER
    from aenv.runtime.vm import snapshot as vm_snapshot
    from aenv.runtime.vm.snapshot import BASE_RAM, DEVICE_STATE, SNAP_DISK

    rt = make_runtime()
    tpl = _template(tmp_path)
    await rt.create(_spec(tmp_path, "src", tpl))
    src = rt.sandbox("src")
    code, marker, _ = await run_cmd(
        rt, "src", "echo disk-at-snapshot > /root/d; sync; echo ram-$$-$RANDOM > /dev/shm/m; sleep 1000 & cat /dev/shm/m"
    )
    assert code == 0 and marker.startswith("ram-")
    snap = tmp_path / "snap1"
    t0 = time.perf_counter()
    result = await rt.snapshot("src", snap, "full")
    snap_ms = (time.perf_counter() - t0) * 1000
    assert result.mode == "full" and result.data["format"] == "layered"
    # The call returns once the sandbox runs again; RAM layer and disk are written after it.
    assert result.pending is not None and (snap / UNFINISHED_MARKER).exists()
    await result.pending
    assert not (snap / UNFINISHED_MARKER).exists() and result.data["ram_layer_bytes"] > 0
    assert result.data["mem_layers"] == ["mem.0.layer"]  # restored from the template: one layer
    for name in (SNAP_DISK, DEVICE_STATE, "mem.0.layer", BASE_RAM):
        assert (snap / name).is_file(), name
    vt = await rt.template_for(_spec(tmp_path, "x", tpl))
    assert os.path.samefile(snap / BASE_RAM, vt.ram_image)  # a link, not a copy
    assert src.disk_generation == 1
    layer_mb = (snap / "mem.0.layer").stat().st_size / 2**20
    print(
        f"\n[vm-rt] snapshot of a running sandbox {snap_ms:.0f} ms (paused {result.paused_ms} ms), "
        f"RAM layer {layer_mb:.1f} MiB"
    )
    assert layer_mb < 200  # changed pages only, not the guest's 256 MiB
    await run_cmd(rt, "src", "echo after-snapshot > /dev/shm/m; echo after > /root/d; sync")  # it runs on

    t0 = time.perf_counter()
    _, states = await fork_via(rt, 
        "src", [_spec(tmp_path, f"kid{i}", tpl) for i in range(2)], tmp_path / "scratch"
    )
    print(f"[vm-rt] fork into 2 children {(time.perf_counter() - t0) * 1000:.0f} ms")
    assert all(not isinstance(s, BaseException) for s in states), states
    assert src.disk_generation == 2
    for i in range(2):
        _, out, _ = await run_cmd(rt, f"kid{i}", "cat /dev/shm/m; ps | grep -c '[s]leep 1000'")
        assert out.split() == ["after-snapshot", "1"], out
    await run_cmd(rt, "kid0", "echo kid0 > /dev/shm/m")
    _, out, _ = await run_cmd(rt, "kid1", "cat /dev/shm/m")
    assert out.strip() == "after-snapshot"  # children do not share memory
    kid_snap = await rt.snapshot("kid0", tmp_path / "snap-kid", "full")  # a restored child, again
    assert kid_snap.pending is not None
    await kid_snap.pending
    assert kid_snap.data["format"] == "layered"
    # incremental: the fork point's layer (linked, not copied) + only what kid0 changed since
    assert kid_snap.data["mem_layers"] == ["mem.0.layer", "mem.1.layer"]
    assert os.path.samefile(tmp_path / "snap-kid" / "mem.0.layer", tmp_path / "scratch" / "mem.0.layer")
    own, parent = ((tmp_path / "snap-kid" / f"mem.{i}.layer").stat().st_size for i in (1, 0))
    print(
        f"[vm-rt] child snapshot: own layer {own / 2**20:.1f} MiB over its parent's {parent / 2**20:.1f} MiB"
    )
    assert own < parent

    # A snapshot makes the runtime spawn a QEMU for the template ahead of time; the rollback
    # restores into it after pointing its disk at the snapshot's.
    for _ in range(200):
        if rt.blank_pool.names():
            break
        await asyncio.sleep(0.05)
    blank = next(iter(rt.blank_pool.names()))
    t0 = time.perf_counter()
    await rt.rollback("src", _spec(tmp_path, "src", tpl), snap, result)
    print(f"[vm-rt] rollback {(time.perf_counter() - t0) * 1000:.0f} ms")
    _, out, _ = await run_cmd(rt, "src", "cat /dev/shm/m; ps | grep -c '[s]leep 1000'")
    assert out.split() == [marker.strip(), "1"], out
    assert rt.sandbox("src") is not src and rt.sandbox("src").name == blank
    # the disk is the snapshot's: read past the (restored) page cache
    _, out, _ = await run_cmd(rt, "src", "echo 3 > /proc/sys/vm/drop_caches; cat /root/d; echo x > /root/e; sync; cat /root/e")
    assert out.split() == ["disk-at-snapshot", "x"], out
    # ... and its header says so: a snapshot of the rolled-back sandbox flattens through it
    again = await rt.snapshot("src", tmp_path / "snap-again", "full")
    await rt.create_from_snapshot(_spec(tmp_path, "again", tpl), tmp_path / "snap-again", again)
    _, out, _ = await run_cmd(rt, "again", "echo 3 > /proc/sys/vm/drop_caches; cat /root/d /root/e")
    assert out.split() == ["disk-at-snapshot", "x"], out
    await rt.kill("again")

    await rt.create_from_snapshot(_spec(tmp_path, "grandkid", tpl), tmp_path / "snap-kid", kid_snap)
    _, out, _ = await run_cmd(rt, "grandkid", "cat /dev/shm/m; echo $E2B_SANDBOX_ID")
    assert out.split() == ["kid0", "grandkid"]
    # a rollback onto another sandbox's snapshot must still give the guest this sandbox's identity
    await rt.rollback("kid0", _spec(tmp_path, "kid0", tpl), snap, result)
    _, out, _ = await run_cmd(rt, "kid0", "cat /dev/shm/m; echo $E2B_SANDBOX_ID")
    assert out.split() == [marker.strip(), "kid0"]
    # past the chain limit a snapshot is compacted into one layer again
    old_max, vm_snapshot.MEM_CHAIN_MAX = vm_snapshot.MEM_CHAIN_MAX, 2
    try:
        deep = await rt.snapshot("grandkid", tmp_path / "snap-deep", "full")
    finally:
        vm_snapshot.MEM_CHAIN_MAX = old_max
    assert deep.data["mem_layers"] == ["mem.0.layer"]
    await rt.create_from_snapshot(_spec(tmp_path, "deep", tpl), tmp_path / "snap-deep", deep)
    _, out, _ = await run_cmd(rt, "deep", "cat /dev/shm/m; ps | grep -c '[s]leep 1000'")
    assert out.split() == ["kid0", "1"]
    last = await rt.snapshot("deep", tmp_path / "snap-last", "full")
    await rt.kill("deep")  # waits for the snapshot's files first: they are read from its disk chain
    assert last.pending is not None and last.pending.done() and last.pending.exception() is None
    assert (tmp_path / "snap-last" / SNAP_DISK).is_file()
    assert not (tmp_path / "snap-last" / UNFINISHED_MARKER).exists()
    await rt.kill("kid1")
    report = await rt.reconcile(set(rt.table.running))
    assert report == {"killed": [], "removed": [], "volume_exports": []}


async def test_paused_vm_released_after_idle_then_adopted_and_resumed(
    make_runtime: Callable[[], VmRuntime], tmp_path: Path
) -> None:
    """Paused longer than ``vm_release_paused_after``: saved to disk, QEMU ended (no RAM held);
    a new runtime (server restart) adopts it from its recorded state and resume restores it, with
    the guest clock set to host time."""
    from aenv.runtime.vm.release import is_released
    from aenv.runtime.vm.table import RELEASED_LAYERED

    rt = make_runtime()
    rt.release.release_after = 0.5
    tpl = _template(tmp_path)
    spec = _spec(tmp_path, "rel", tpl)
    state = await rt.create(spec)
    pid = state.data["pid"]
    run_dir = Path(state.data["run_dir"])
    assert await _health(rt, "rel") in (200, 204)
    paused = await rt.pause("rel")
    assert "released" not in paused.data
    for _ in range(600):
        if is_released(run_dir) and "rel" not in rt.table.running:
            break
        await asyncio.sleep(0.05)
    assert (run_dir / RELEASED_LAYERED).is_file()  # device state + changed pages, not all of RAM
    assert (run_dir / "released.layer").stat().st_size < 100 * 2**20
    await asyncio.sleep(0.1)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    sample = await rt.metrics("rel")
    assert sample.mem_used == 0

    # restart: the old runtime's objects vanish; the new one adopts from the state recorded at pause
    rt.table.released.clear()
    rt.table.specs.clear()
    new = make_runtime()
    assert await new.adopt("rel", spec, paused)
    assert "rel" in new.table.released
    await asyncio.sleep(2.0)  # the saved guest clock falls behind meanwhile
    resumed = await new.resume("rel", paused)
    assert resumed.data["pid"] != pid
    assert not is_released(run_dir)
    _, out, _ = await run_cmd(new, "rel", "date +%s; echo kept > /dev/shm/k")  # HELLO set the clock
    assert abs(int(out.split()[0]) - time.time()) < 2, out
    # released again and back: the restored VM's base image (linked in its run dir) is reused
    new.release.release_after = 0
    await new.pause("rel")
    assert is_released(run_dir) and "rel" in new.table.released
    resumed = await new.resume("rel", resumed)
    _, out, _ = await run_cmd(new, "rel", "cat /dev/shm/k")
    assert out.strip() == "kept"
    await new.kill("rel", resumed)
    assert not run_dir.exists()


async def test_memory_pressure_releases_paused_vms_longest_paused_first(
    make_runtime: Callable[[], VmRuntime], tmp_path: Path
) -> None:
    """Below ``vm_memory_low_mb`` available (here: a mark no host reaches, so always), paused VMs go
    to disk at once instead of after their idle period, the longest-paused first; running ones stay.
    A released one resumes from disk with its processes' state."""
    from aenv.runtime.vm.release import is_released

    rt = make_runtime()
    rt.release.release_after = 3600.0  # the idle release would never come within the test
    rt.release.memory_low_mb = 1e12
    rt.release.pressure_interval = 3600.0  # rounds are driven by hand below
    tpl = _template(tmp_path)
    states = {sid: await rt.create(_spec(tmp_path, sid, tpl)) for sid in ("mp1", "mp2", "mp3")}
    await rt.pause("mp2")
    await asyncio.sleep(0.05)
    await rt.pause("mp1")
    assert await rt.relieve_pressure() == ["mp2", "mp1"]
    for sid in ("mp1", "mp2"):
        assert is_released(Path(states[sid].data["run_dir"]))
        with pytest.raises(ProcessLookupError):
            os.kill(states[sid].data["pid"], 0)
    assert await _health(rt, "mp3") in (200, 204)  # running: untouched
    assert await rt.relieve_pressure() == []
    rt.release.memory_low_mb = 0  # off: a paused VM stays in RAM
    await rt.pause("mp3")
    assert await rt.relieve_pressure() == []
    resumed = await rt.resume("mp1", rt.table.state_of("mp1"))
    assert resumed.data["pid"] != states["mp1"].data["pid"]
    assert await _health(rt, "mp1") in (200, 204)
    for sid in ("mp1", "mp2", "mp3"):
        await rt.kill(sid)


async def test_image_layers_are_merged_into_the_vm_disk(
    make_runtime: Callable[[], VmRuntime], tmp_path: Path
) -> None:
    """An image template's lowers (top first, with overlay whiteouts) become one ext4 tree, as the ns
    runtime's overlay shows them: what the top layer adds is there, what it whites out is gone."""
    import stat

    base = _template(tmp_path)
    middle, top = tmp_path / "layer-middle", tmp_path / "layer-top"
    (middle / "etc").mkdir(parents=True)
    (middle / "etc" / "motd").write_text("from the middle layer\n")
    (top / "etc").mkdir(parents=True)
    (top / "etc" / "layer.txt").write_text("from the top layer\n")
    os.mknod(top / "etc" / "motd", stat.S_IFCHR | 0o600, os.makedev(0, 0))  # whiteout of the middle's file
    tpl = SandboxImage("layered", base.rootfs, lowers=(top, middle, base.rootfs))
    rt = make_runtime()
    await rt.create(_spec(tmp_path, "lay", tpl))

    async def get(path: str) -> tuple[int, bytes]:
        stream = await rt.open_stream("lay", 49983)
        return await request(stream, "GET", f"/files?path={path}&username=root")

    assert await get("/etc/layer.txt") == (200, b"from the top layer\n")
    assert (await get("/etc/motd"))[0] == 404
    assert (await get("/etc/passwd"))[0] == 200  # the bottom layer is there too
    assert not any(p.name == "merged-layers" for p in rt.templates_dir.rglob("merged-layers"))
    await rt.kill("lay")


def _data_map(path: Path) -> tuple[list[tuple[int, int]], str]:
    """The file's allocated ranges (SEEK_DATA/SEEK_HOLE) and its content digest."""
    import hashlib

    ranges: list[tuple[int, int]] = []
    with path.open("rb") as f:
        fd, size, pos = f.fileno(), os.fstat(f.fileno()).st_size, 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:
                break
            pos = os.lseek(fd, start, os.SEEK_HOLE)
            ranges.append((start, pos))
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return ranges, digest


async def test_a_sandbox_giving_memory_back_cannot_change_its_template(
    make_runtime: Callable[[], VmRuntime], tmp_path: Path
) -> None:
    """QEMU 7.2 punches a hole in the RAM *file* when a guest gives memory back, even with the
    file mapped private (the template, under every sandbox of it). Inflate one sandbox's
    balloon from the host: its template RAM must not change, and QEMU must have tried and been
    refused (so the test would see a punch if the store allowed one)."""
    rt = make_runtime()
    tpl = _template(tmp_path)
    spec = _spec(tmp_path, "giver", tpl)
    vt = await rt.template_for(spec)
    assert is_frozen_store(vt.mem_path)
    await rt.create(spec)
    await rt.create(_spec(tmp_path, "neighbour", tpl))
    before = _data_map(vt.mem_path)

    machine = rt.sandbox("giver").machine
    await machine.execute("balloon", {"value": 96 * 2**20})
    for _ in range(200):
        if (await machine.execute("query-balloon"))["actual"] <= 128 * 2**20:
            break
        await asyncio.sleep(0.1)
    assert (await machine.execute("query-balloon"))["actual"] <= 128 * 2**20, "the guest never inflated"
    await machine.execute("balloon", {"value": 256 * 2**20})

    assert _data_map(vt.mem_path) == before
    refused = (rt.sandbox("giver").run_dir / "qemu.stderr").read_text(errors="replace")
    assert "ram_block_discard_range" in refused, "QEMU never tried to discard: the test proved nothing"
    assert await _health(rt, "neighbour") in (200, 204)
    assert await _health(rt, "giver") in (200, 204)



async def test_internet_vm_reaches_the_internet_but_nothing_of_the_host(
    make_runtime: Callable[[], VmRuntime], tmp_path: Path
) -> None:
    """QEMU's slirp maps the guest's 10.0.2.2 to 127.0.0.1 and connects from the QEMU process: in
    the host's namespace that is the aenv API and every host service. Jailed (netjail.py), a guest
    with internet reaches a public address (a test host in a netns of its own) but no host address
    and no loopback, in a created sandbox and in a fork child (a restore: a new QEMU)."""
    from tests.fixtures.nethost import HostListener, host_addrs, public_host

    listener = HostListener(host_addrs())  # accepts and closes: a breach shows as OPEN, not a hang
    rt = make_runtime()
    tpl = _template(tmp_path)
    try:
        with public_host() as public:
            await rt.create(_spec(tmp_path, "inet", tpl, allow_internet=True))
            _, kids = await fork_via(rt, "inet", [_spec(tmp_path, "inet-kid", tpl, allow_internet=True)],
                                    tmp_path / "inet-fork")
            assert not isinstance(kids[0], BaseException), kids
            probe_host = "; ".join(
                f"nc -w 3 {a} {listener.port} </dev/null >/dev/null 2>&1 && echo OPEN:{a}"
                for a in [*host_addrs(), "10.0.2.2"]
            )
            for sid in ("inet", "inet-kid"):
                pid = rt.sandbox(sid).machine.pid
                assert os.stat(f"/proc/{pid}/ns/net").st_ino != os.stat("/proc/self/ns/net").st_ino
                assert Path(f"/proc/{pid}/root/etc/resolv.conf").read_text() == "nameserver 10.0.2.3\n"
                # busybox's static wget crashes in this guest; nc speaks HTTP/1.0 well enough
                get = f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 10 {public.addr} {public.port}"
                code, out, err = await run_cmd(rt, sid, get)
                assert code == 0 and out.endswith("\r\n\r\n" + public.body), (sid, code, out, err)
                _, out, _ = await run_cmd(rt, sid, probe_host)
                assert "OPEN" not in out, (sid, out)
            assert listener.accepted == 0, "a guest connection reached the host"
            slirps = [rt.sandbox(s).machine.slirp for s in ("inet", "inet-kid")]
            assert all(s is not None and s.ref.alive() for s in slirps)
            for sid in ("inet", "inet-kid"):
                await rt.kill(sid)
            assert all(s is not None and not s.ref.alive() for s in slirps)  # they end with their QEMU
    finally:
        listener.close()


def _pool_qemus(rt: VmRuntime) -> list[int]:
    """QEMU processes of the runtime's pool entries (run dirs ``pool-*`` under its run root)."""
    from aenv.runtime.vm.reconcile import qemu_cmdlines

    marker = f"{rt.run_root}/pool-".encode()
    return [pid for pid, cmd in qemu_cmdlines().items() if marker in cmd]


async def test_close_ends_the_pools_and_frees_template_ram_once_no_sandbox_is_left(
    make_runtime: Callable[[], VmRuntime], tmp_path: Path
) -> None:
    """Server stop (``close``): every pool QEMU ends, warm and blank, including one still being
    spawned; user sandboxes outlive it, and so does the template RAM in /dev/shm while one of them
    is left. Once none is, the next close removes the RAM dir too."""
    tpl = _template(tmp_path)
    rt = make_runtime()
    state = await rt.create(_spec(tmp_path, "stays", tpl))  # the warm pool starts refilling now
    key = (await rt.template_for(_spec(tmp_path, "x", tpl))).key
    rt.blank_pool.want(key, True)
    for _ in range(400):  # a pool QEMU runs but no entry is ready yet: close lands mid-spawn
        if _pool_qemus(rt):
            break
        await asyncio.sleep(0.02)
    assert _pool_qemus(rt) and not rt.pool.names(), "no pool spawn in flight to close"
    await rt.close()
    await asyncio.sleep(0.1)
    assert _pool_qemus(rt) == [] and not any(rt.run_root.glob("pool-*"))
    os.kill(state.data["pid"], 0)  # the user's sandbox runs on
    assert rt.shm_dir.is_dir() and any(rt.frozen_dir.iterdir()), "template RAM removed under a sandbox"

    await rt.sandbox("stays").machine.qmp.disconnect()  # the stopped server's process is gone
    rt.table.running.clear()
    new = make_runtime()  # a later server: the sandbox goes, a pool entry comes, then it stops
    assert await new.adopt("stays", _spec(tmp_path, "stays", tpl), state)
    await new.kill("stays", state)
    await new.template_for(_spec(tmp_path, "x", tpl))
    new.pool.want(key, True)
    for _ in range(1200):
        if new.pool.names():
            break
        await asyncio.sleep(0.05)
    assert new.pool.names()
    await new.close()
    await asyncio.sleep(0.1)
    _no_qemu_under(new.run_root)
    assert not new.shm_dir.exists()

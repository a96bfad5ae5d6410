"""NsRuntime driven directly (no HTTP server): lifecycle, envd through the mux, pause/resume, clean
kill, isolation and restart recovery.

Rootfs: a busybox-static tree built here (no libc inside, so it also proves the tools bundle is
self-contained) and, when another part of the project has built it, the Debian ``base`` rootfs.
Needs root, cgroups and Debian's busybox-static; skips otherwise. No wall-clock assertions.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from aenv.config import Settings, default_cache_dir
from aenv.runtime.base import RuntimeState, SandboxImage, SandboxSpec
from aenv.runtime.envd_client import request
from aenv.runtime.network import slirp_available
from aenv.runtime.ns import NsRuntime
from aenv.runtime.ns.cgroups import Cgroup
from tests.fixtures.envd import run_cmd

pytestmark = [pytest.mark.asyncio(loop_scope="module")]

BUSYBOX = Path("/bin/busybox")
ENVD = 49983
LOADER_PY = "/.aenv/lib/ld-linux-x86-64.so.2 --inhibit-cache --library-path /.aenv/lib /.aenv/bin/python3.11 -I"


def _static(path: Path) -> bool:
    out = subprocess.run(["ldd", str(path)], capture_output=True, text=True, check=False)
    return "not a dynamic executable" in (out.stdout + out.stderr) or "statically linked" in out.stdout


def build_busybox_rootfs(dest: Path) -> Path:
    """/bin/busybox + applet symlinks + passwd/group with root and user (uid 1000)."""
    for d in ("bin", "sbin", "etc", "root", "home/user", "proc", "dev", "tmp", "usr/bin"):
        (dest / d).mkdir(parents=True, exist_ok=True)
    os.chmod(dest / "tmp", 0o1777)
    shutil.copy2(BUSYBOX, dest / "bin" / "busybox")
    applets = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True, check=True).stdout.split()
    for name in applets:
        link = dest / "bin" / name
        if not link.exists():
            link.symlink_to("busybox")
    (dest / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\n")
    (dest / "etc" / "group").write_text("root:x:0:\nuser:x:1000:\n")
    os.chown(dest / "home" / "user", 1000, 1000)
    return dest


@pytest.fixture(scope="module")
def busybox_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if os.geteuid() != 0:
        pytest.skip("the ns runtime needs root")
    if not BUSYBOX.exists() or not _static(BUSYBOX):
        pytest.skip("needs Debian's busybox-static at /bin/busybox")
    if not Path("/sys/fs/cgroup").is_dir():
        pytest.skip("needs cgroups")
    return build_busybox_rootfs(tmp_path_factory.mktemp("bbroot"))


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """As a server's: sandboxes in the default user namespace (``AENV_NS_USERNS_UID`` picks another
    base, or 0 for none)."""
    cache = Path(os.environ.get("AENV_CACHE_DIR") or default_cache_dir())
    userns = os.environ.get("AENV_NS_USERNS_UID")
    return Settings(state_dir=tmp_path_factory.mktemp("state"), cache_dir=cache, pool_size=1,
                    **({"ns_userns_uid": int(userns)} if userns else {}))


@pytest.fixture(scope="module")
def template(busybox_root: Path) -> SandboxImage:
    return SandboxImage("busybox", busybox_root)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rt(settings: Settings, busybox_root: Path) -> AsyncIterator[NsRuntime]:
    runtime = NsRuntime(settings, pool_size=1)
    await runtime.start()
    await runtime.reconcile(set())
    yield runtime
    for sid in list(runtime.table.running):
        await runtime.kill(sid)
    await runtime.close()
    await runtime.reconcile(set())


_counter = 0


def spec_for(settings: Settings, template: SandboxImage, **kw: object) -> SandboxSpec:
    global _counter
    _counter += 1
    sid = f"t{os.getpid() % 10000}x{_counter}"
    return SandboxSpec(sandbox_id=sid, template=template, workdir=settings.sandboxes_dir / sid,
                       allow_internet=bool(kw.pop("allow_internet", False)), **kw)  # type: ignore[arg-type]


# ---- talking to envd ------------------------------------------------------------------------------


async def health(rt: NsRuntime, sid: str) -> int:
    status, _ = await request(await rt.open_stream(sid, ENVD), "GET", "/health")
    return status


# ---- leak checks ----------------------------------------------------------------------------------


def traces(rt: NsRuntime, sid: str, state: RuntimeState) -> list[str]:
    """Everything of sandbox ``sid`` that still exists on the host."""
    found: list[str] = []
    pid, start = state.data["pid"], state.data["start"]
    from aenv.runtime.process import proc_start_time

    if proc_start_time(pid) == start:
        found.append(f"process {pid}")
    assert rt.host.layout is not None
    for parent in rt.host.layout.parents():
        if (parent / sid).exists():
            found.append(f"cgroup {parent / sid}")
    if Path(state.data["workdir"]).exists():
        found.append(f"dir {state.data['workdir']}")
    if state.data["workdir"] in Path("/proc/self/mountinfo").read_text():
        found.append("host mount")
    if state.data.get("slirp") and proc_start_time(state.data["slirp"][0]) == state.data["slirp"][1]:
        found.append("slirp4netns")
    return found


def _nices(cg: Cgroup) -> set[int]:
    """The nice of every thread of every process in ``cg``."""
    out: set[int] = set()
    for pid in cg.pids():
        for tid in os.listdir(f"/proc/{pid}/task"):
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            out.add(int(stat.rsplit(")", 1)[1].split()[16]))  # field 19: nice
    return out


def _cpu_weight(cg: Cgroup) -> str:
    if cg.layout.version == 2:
        raw, lowest, ordinary = (cg.dir("cpu") / "cpu.weight").read_text().strip(), "1", "100"
    else:
        raw, lowest, ordinary = (cg.dir("cpu") / "cpu.shares").read_text().strip(), "2", "1024"
    return {lowest: "lowest", ordinary: "ordinary"}.get(raw, raw)


# ---- tests ----------------------------------------------------------------------------------------


async def test_cold_create_health_and_clean_kill(settings: Settings, template: SandboxImage) -> None:
    cold = NsRuntime(settings, pool_size=0)
    await cold.start()
    spec = spec_for(settings, template)
    state = await cold.create(spec)
    try:
        assert await health(cold, spec.sandbox_id) == 204
        code, out, _ = await run_cmd(cold, spec.sandbox_id, "echo hello; hostname; cat /proc/1/cmdline | tr '\\0' ' '")
        assert code == 0
        assert out.startswith("hello\n")
        assert "aenv.agent" in out  # the agent is PID 1
    finally:
        await cold.kill(spec.sandbox_id)
        await cold.close()
    assert traces(cold, spec.sandbox_id, state) == []


async def test_pooled_create_runs_commands_and_sets_limits(rt: NsRuntime, settings: Settings,
                                                           template: SandboxImage) -> None:
    await rt.wait_warm(template, False)
    pooled = next(iter(rt.pool.names()))
    assert rt.host.layout is not None
    pooled_cgroup = Cgroup(rt.host.layout, pooled)
    # waiting in the pool: the lowest CPU weight, processes not niced (nothing to undo at hand-out)
    assert _cpu_weight(pooled_cgroup) == "lowest"
    assert _nices(pooled_cgroup) == {0}
    spec = spec_for(settings, template, cpu_count=1, memory_mb=200, pids_limit=321)
    state = await rt.create(spec)
    assert state.data["cgroup"] == spec.sandbox_id
    sbx = rt.sandbox(spec.sandbox_id)
    assert sbx.paths.root == spec.workdir / "ns"
    if pooled not in rt.pool.names():  # this create took it: a live sandbox's weight, still no nice
        assert _cpu_weight(sbx.cgroup) == "ordinary"
        assert _nices(sbx.cgroup) == {0}
    if rt.host.layout and rt.host.layout.version == 1:
        assert (sbx.cgroup.dir("pids") / "pids.max").read_text().strip() == "321"
        assert int((sbx.cgroup.dir("memory") / "memory.limit_in_bytes").read_text()) == 200 * 1024 * 1024
        assert (sbx.cgroup.dir("cpu") / "cpu.cfs_quota_us").read_text().strip() == "100000"
    code, out, _ = await run_cmd(rt, spec.sandbox_id, "id -u; echo $HOME", user="user")
    assert code == 0 and out.split()[0] == "1000"
    code, _, _ = await run_cmd(rt, spec.sandbox_id, "exit 7")
    assert code == 7
    sample = await rt.metrics(spec.sandbox_id)
    assert sample.mem_used > 0 and sample.mem_total == 200 * 1024 * 1024
    await rt.kill(spec.sandbox_id)
    assert traces(rt, spec.sandbox_id, state) == []


async def test_pause_freezes_and_resume_continues(rt: NsRuntime, settings: Settings, busybox_root: Path) -> None:
    counting = SandboxImage(
        "busybox-counter", busybox_root,
        start_cmd="i=0; while :; do i=$((i+1)); echo $i > /tmp/counter.new; mv /tmp/counter.new /tmp/counter; usleep 5000; done",
    )
    spec = spec_for(settings, counting)
    state = await rt.create(spec)
    counter = spec.workdir / "ns" / "upper" / "tmp" / "counter"

    async def value() -> int:
        for _ in range(400):
            try:
                text = counter.read_text().strip()
                if text:
                    return int(text)
            except (FileNotFoundError, ValueError):
                pass
            await asyncio.sleep(0.01)
        raise AssertionError("counter never written")

    async def advances(v0: int) -> bool:
        for _ in range(300):
            if await value() > v0:
                return True
            await asyncio.sleep(0.01)
        return False

    assert await advances(await value())
    paused = await rt.pause(spec.sandbox_id)
    assert rt.sandbox(spec.sandbox_id).cgroup.frozen()
    v1 = await value()
    await asyncio.sleep(0.3)
    assert await value() == v1, "counter moved while frozen"
    await rt.resume(spec.sandbox_id, paused)
    assert await advances(v1)
    assert await health(rt, spec.sandbox_id) == 204
    await rt.kill(spec.sandbox_id)
    assert traces(rt, spec.sandbox_id, state) == []


@pytest.fixture
def host_listeners() -> Iterator[dict[str, int]]:
    """TCP listeners on the host's loopback and on all addresses; the sandbox must reach neither."""
    socks: list[socket.socket] = []
    ports: dict[str, int] = {}
    for name, addr in (("loopback", "127.0.0.1"), ("any", "0.0.0.0")):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, 0))
        s.listen(16)
        socks.append(s)
        ports[name] = s.getsockname()[1]
    stop = threading.Event()

    def serve(s: socket.socket) -> None:
        s.settimeout(0.1)
        while not stop.is_set():
            try:
                c, _ = s.accept()
                c.sendall(b"HOST-SECRET\n")
                c.close()
            except OSError:
                continue

    threads = [threading.Thread(target=serve, args=(s,), daemon=True) for s in socks]
    for t in threads:
        t.start()
    yield ports
    stop.set()
    for t in threads:
        t.join()
    for s in socks:
        s.close()


def _host_addr() -> str:
    out = subprocess.run(["ip", "-o", "-4", "addr", "show", "scope", "global"], capture_output=True, text=True, check=False)
    for line in out.stdout.splitlines():
        parts = line.split()
        return parts[parts.index("inet") + 1].split("/")[0]
    return "127.0.0.1"


@pytest.mark.parametrize("internet", [False, True], ids=["offline", "internet"])
async def test_isolation_files_processes_host_services(rt: NsRuntime, settings: Settings, template: SandboxImage,
                                                      host_listeners: dict[str, int], tmp_path: Path,
                                                      internet: bool) -> None:
    if internet and not slirp_available():
        pytest.skip("slirp4netns/iptables not installed")
    secret = tmp_path / "host-secret.txt"
    secret.write_text("TOP-SECRET")
    spec = spec_for(settings, template, allow_internet=internet)
    state = await rt.create(spec)
    sid = spec.sandbox_id
    try:
        _, out, _ = await run_cmd(rt, sid, f"cat {secret} 2>&1; ls {settings.state_dir} 2>&1; echo done")
        assert "TOP-SECRET" not in out and out.strip().endswith("done")
        _, out, _ = await run_cmd(rt, sid, "ls /proc | grep -c '^[0-9]'; cat /proc/*/cmdline 2>/dev/null | tr '\\0' ' '")
        assert "pytest" not in out
        assert int(out.split()[0]) < 20
        host = _host_addr()
        for addr, port in (("127.0.0.1", host_listeners["loopback"]), ("127.0.0.1", host_listeners["any"]),
                           (host, host_listeners["any"]), ("10.0.2.2", host_listeners["loopback"])):
            _, out, _ = await run_cmd(rt, sid, f"nc -w 2 {addr} {port} </dev/null 2>&1; echo rc=$?")
            assert "HOST-SECRET" not in out, (addr, port)
        # sandbox root cannot make device nodes, mount, or open the host's disk
        _, out, _ = await run_cmd(rt, sid, "mknod /tmp/vda b 254 0 2>&1; echo m=$?; mount -t tmpfs x /mnt 2>&1; echo t=$?")
        assert "m=0" not in out and "t=0" not in out
        # host-global kernel knobs are read-only, loader settings never leak into user processes
        _, out, _ = await run_cmd(rt, sid, "echo x > /proc/sys/kernel/core_pattern 2>&1; echo c=$?; "
                                              "echo h > /proc/sysrq-trigger 2>&1; echo s=$?; env")
        assert "c=0" not in out and "s=0" not in out
        assert "LD_" not in out and "PYTHONHOME" not in out and "/.aenv" not in out
        if internet:
            _code, out, _ = await run_cmd(rt, sid, "cat /proc/net/route; cat /etc/resolv.conf")
            assert "tap0" in out and "10.0.2.3" in out
    finally:
        await rt.kill(sid)
    assert traces(rt, sid, state) == []


async def test_memory_bomb_is_killed_inside_its_cgroup(rt: NsRuntime, settings: Settings,
                                                      template: SandboxImage) -> None:
    spec = spec_for(settings, template, memory_mb=96)
    await rt.create(spec)
    sid = spec.sandbox_id
    sbx = rt.sandbox(sid)
    bomb = f"{LOADER_PY} -c 'a=[]\nwhile True: a.append(b\"x\" * 10**7)'"
    _, out, _err = await run_cmd(rt, sid, f"{bomb}; echo exit=$?")
    assert "exit=0" not in out
    assert sbx.cgroup.oom_kills() >= 1
    assert await health(rt, sid) == 204  # envd survived (or was restarted by the agent)
    _code, out, _ = await run_cmd(rt, sid, "echo still-alive")
    assert out.strip() == "still-alive"
    await rt.kill(sid)


async def test_fork_bomb_hits_pids_limit(rt: NsRuntime, settings: Settings, template: SandboxImage) -> None:
    spec = spec_for(settings, template, pids_limit=40)
    await rt.create(spec)
    sid = spec.sandbox_id
    _code, _out, _err = await run_cmd(rt, sid, "for i in $(seq 100); do sleep 30 & done 2>/dev/null; echo spawned")
    sbx = rt.sandbox(sid)
    assert len(sbx.cgroup.pids()) <= 40
    if rt.host.layout and rt.host.layout.version == 1:
        events = (sbx.cgroup.dir("pids") / "pids.events").read_text()
        assert int(events.split()[1]) > 0
    await asyncio.to_thread(lambda: [os.kill(p, 9) for p in sbx.cgroup.pids() if
                                     Path(f"/proc/{p}/comm").read_text().strip() == "sleep"])
    assert await health(rt, sid) == 204
    await rt.kill(sid)


async def test_restart_adopts_known_and_reaps_unknown(settings: Settings, template: SandboxImage,
                                                     tmp_path: Path) -> None:
    # its own state dir: reconciliation of a second runtime would (rightly) reap the module pool
    settings = settings.model_copy(update={"state_dir": tmp_path / "state"})
    first = NsRuntime(settings, pool_size=0)
    await first.start()
    keep_spec = spec_for(settings, template)
    lost_spec = spec_for(settings, template)
    keep_state = await first.create(keep_spec)
    lost_state = await first.create(lost_spec)
    paused = await first.pause(keep_spec.sandbox_id)
    await first.close()  # the "server" goes away; sandboxes keep running

    second = NsRuntime(settings, pool_size=0)
    await second.start()
    report = await second.reconcile({keep_spec.sandbox_id})
    assert lost_spec.sandbox_id in report.killed
    assert traces(second, lost_spec.sandbox_id, lost_state) == []
    assert await second.adopt(keep_spec.sandbox_id, keep_spec, paused)
    await second.resume(keep_spec.sandbox_id, paused)
    assert await health(second, keep_spec.sandbox_id) == 204
    _code, out, _ = await run_cmd(second, keep_spec.sandbox_id, "echo adopted")
    assert out.strip() == "adopted"
    await second.kill(keep_spec.sandbox_id)
    assert traces(second, keep_spec.sandbox_id, keep_state) == []
    assert not await second.adopt(keep_spec.sandbox_id, keep_spec, keep_state)
    await second.close()


async def test_debian_base_rootfs(rt: NsRuntime, settings: Settings) -> None:
    try:
        from aenv.images.bootstrap import base_rootfs_path

        base = base_rootfs_path(settings)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"base rootfs unavailable: {exc}")
    if not base.is_dir():
        pytest.skip("base rootfs not built (scripts/setup.sh builds it)")
    spec = spec_for(settings, SandboxImage("base", base))
    state = await rt.create(spec)
    code, out, _ = await run_cmd(rt, spec.sandbox_id, "python3 -c 'import sys; print(sys.version_info[0])'; bash -lc 'echo $0'")
    assert code == 0 and out.split()[0] == "3"
    await rt.kill(spec.sandbox_id)
    assert traces(rt, spec.sandbox_id, state) == []


async def test_sandboxes_do_not_see_each_other(rt: NsRuntime, settings: Settings, template: SandboxImage) -> None:
    a, b = spec_for(settings, template), spec_for(settings, template)
    await rt.create(a)
    await rt.create(b)
    try:
        await run_cmd(rt, a.sandbox_id, "echo from-a > /tmp/mine; echo shm > /dev/shm/x; sleep 60 >/dev/null 2>&1 &")
        _, out, _ = await run_cmd(rt, b.sandbox_id, "cat /tmp/mine /dev/shm/x 2>&1; ps -o comm 2>/dev/null | grep -c sleep; "
                                                    f"ls {a.workdir} 2>&1")
        assert "from-a" not in out and "shm\n" not in out
        assert out.splitlines()[-2].strip() == "0"  # a's sleep is invisible in b
        a_upper = a.workdir / "ns" / "upper" / "tmp" / "mine"
        assert a_upper.read_text() == "from-a\n"  # the write landed in a's own upper dir only
        assert not (b.workdir / "ns" / "upper" / "tmp" / "mine").exists()
    finally:
        await rt.kill(a.sandbox_id)
        await rt.kill(b.sandbox_id)

"""E2B volumes through the unmodified SDK (``from e2b import Volume, Sandbox``) against a real server:
create/list/connect/destroy, the volume content API, a volume written in one sandbox and read in
another, a read-only mount that refuses writes, one writer at a time, and volumes that survive a
kill -9 of the server; fork, pause to disk and a files-only pause with a volume mounted. Both
runtimes: ns binds the volume's directory, vm serves it over its 9p export (runtime/vm/volumes.py),
where a copy in another QEMU must mount it again (a volume in use refuses a fork: 409).

A server of its own (module scope): the kill -9 test restarts it on the same state dir and port.
"""

from __future__ import annotations

import io
import os
import secrets
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from e2b import CommandExitException, Sandbox, SandboxException, Volume
from e2b.exceptions import NotFoundException, VolumeException, VolumeNotFoundException

from aenv.runtime.ns.criu import probe as criu_probe
from aenv.runtime.vm.release import is_released
from aenv.testing.server import API_KEY, Server, free_port, start_server, stop_server
from tests.integration.conftest import _needs_runtime

pytestmark = pytest.mark.sdk
CRIU = criu_probe()


USERNS_BASE = 1_200_000_000  # the default ns_userns_uid
VOLUME_MB = 64  # each volume's size limit in these servers


@dataclass
class Running:
    srv: Server
    extra: dict[str, str]  # the server's settings, for a restart


def _in_userns(vserver: Running) -> bool:
    return vserver.extra.get("AENV_NS_USERNS_UID") != "0"


@pytest.fixture(scope="module", params=["plain", "userns"])
def vserver(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
            runtime_name: str) -> Iterator[Running]:
    """The kill -9 test swaps in the restarted server. Twice on ns: sandboxes as host root
    (``ns_userns_uid = 0``), and in the default user namespace (there the volume is bound idmapped)."""
    _needs_runtime(runtime_name)
    if request.param == "userns" and runtime_name != "ns":
        pytest.skip("user namespaces are the ns runtime's")
    tmp = tmp_path_factory.mktemp("aenv-volumes")
    # paused sandboxes are released (CRIU-dumped, processes ended) at once: the release path with volumes
    extra = {"AENV_POOL_SIZE": "1", "AENV_NS_RELEASE_PAUSED_AFTER": "0", "AENV_VM_RELEASE_PAUSED_AFTER": "0",
             "AENV_VOLUME_SIZE_MB": str(VOLUME_MB),
             **({"AENV_NS_USERNS_UID": "0"} if request.param == "plain" else {})}
    running = Running(start_server(tmp, runtime_name, extra, port=free_port()), extra)
    yield running
    stop_server(running.srv)


@pytest.fixture
def env(vserver: Running, monkeypatch: pytest.MonkeyPatch) -> Server:
    srv = vserver.srv
    for k, v in {"E2B_API_URL": srv.url, "E2B_SANDBOX_URL": srv.url, "E2B_VOLUME_API_URL": srv.url,
                 "E2B_API_KEY": API_KEY, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}.items():
        monkeypatch.setenv(k, v)
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(k, raising=False)
    return srv


@pytest.fixture
def kills() -> Iterator[list[Sandbox]]:
    """Sandboxes a test made: killed after it, whatever happened."""
    made: list[Sandbox] = []
    yield made
    for s in made:
        try:
            s.kill()
        except Exception:
            pass


@pytest.fixture
def ns_only(runtime_name: str) -> None:
    if runtime_name != "ns":
        pytest.skip("ns: a process fork with CRIU (vm: test_vm_fork_shares_the_volume_read_only)")


@pytest.fixture
def vm_only(runtime_name: str) -> None:
    if runtime_name != "vm":
        pytest.skip("the vm runtime's 9p export (ns: the tests beside it)")


def _name() -> str:
    return f"vol-{secrets.token_hex(4)}"


def test_volume_lifecycle(env: Server) -> None:
    vol = Volume.create(_name())
    assert vol.volume_id and vol.token
    info = Volume.get_info(vol.volume_id)
    assert (info.volume_id, info.name, info.token) == (vol.volume_id, vol.name, vol.token)
    assert vol.volume_id in {v.volume_id for v in Volume.list()}
    again = Volume.connect(vol.volume_id)
    assert again.token == vol.token and again.name == vol.name
    with pytest.raises(VolumeException):
        Volume.create(vol.name)  # names are unique (409)
    assert Volume.destroy(vol.volume_id) is True
    assert Volume.destroy(vol.volume_id) is False
    with pytest.raises(VolumeNotFoundException):
        Volume.get_info(vol.volume_id)


def test_content_api(env: Server) -> None:
    vol = Volume.create(_name())
    try:
        vol.write_file("/hello.txt", "Hello, World!")
        assert vol.read_file("/hello.txt") == "Hello, World!"
        vol.write_file("/bin.dat", bytes(range(256)) * 4096)  # 1 MiB: more than one upload chunk
        assert vol.read_file("/bin.dat", format="bytes") == bytes(range(256)) * 4096
        vol.write_file("/s.txt", io.BytesIO(b"streamed"))
        assert b"".join(vol.read_file("/s.txt", format="stream")) == b"streamed"
        with pytest.raises(VolumeException):
            vol.write_file("/hello.txt", "again")  # exists, no force
        vol.write_file("/hello.txt", "again", force=True)
        vol.make_dir("/a/b", force=True)
        vol.write_file("/a/b/f.txt", "nested", uid=1000, gid=1000, mode=0o600)
        info = vol.get_info("/a/b/f.txt")
        assert (info.type.value, info.size, info.uid, info.mode) == ("file", 6, 1000, 0o600)
        assert {e.name for e in vol.list("/")} == {"hello.txt", "bin.dat", "s.txt", "a"}
        assert vol.update_metadata("/a/b/f.txt", mode=0o644).mode == 0o644
        assert vol.exists("/a/b") and not vol.exists("/nope")
        vol.remove("/a")
        assert not vol.exists("/a/b/f.txt")
        with pytest.raises(NotFoundException):
            vol.remove("/a")
        with pytest.raises(NotFoundException):
            vol.read_file("/nope")
    finally:
        Volume.destroy(vol.volume_id)


def test_written_in_one_sandbox_read_in_another(env: Server, vserver: Running, kills: list[Sandbox],
                                                runtime_name: str) -> None:
    vol = Volume.create(_name())
    first = Sandbox.create("base", volume_mounts={"/mnt/data": vol}, timeout=120)
    kills.append(first)
    if runtime_name == "ns":
        uid_map = first.commands.run("cat /proc/self/uid_map").stdout.split()
        assert (uid_map[1] == str(USERNS_BASE)) is _in_userns(vserver), uid_map
    first.files.write("/mnt/data/hello.txt", "from the first sandbox")
    uid = int(first.commands.run("mkdir -p /mnt/data/sub && echo made-by-shell > /mnt/data/sub/b.txt && id -u").stdout)
    first.kill()
    assert vol.get_info("/sub/b.txt").uid == uid  # the owner the sandbox saw (idmapped in a user namespace)
    assert vol.read_file("/hello.txt") == "from the first sandbox"  # the content API sees it too
    vol.write_file("/from-api.txt", "from the content API")

    second = Sandbox.create("base", volume_mounts={"/data": vol.name}, timeout=120)  # by name, elsewhere
    kills.append(second)
    assert second.files.read("/data/hello.txt") == "from the first sandbox"
    assert second.commands.run("cat /data/sub/b.txt /data/from-api.txt").stdout == "made-by-shell\nfrom the content API"
    second.kill()
    Volume.destroy(vol.volume_id)


def test_read_only_mount_refuses_writes(env: Server, kills: list[Sandbox]) -> None:
    vol = Volume.create(_name())
    writer = Sandbox.create("base", volume_mounts={"/w": vol}, timeout=120)
    kills.append(writer)
    with pytest.raises(SandboxException) as info:  # one writer at a time
        kills.append(Sandbox.create("base", volume_mounts={"/w": vol}, timeout=120))
    assert "read-write" in str(info.value) and writer.sandbox_id in str(info.value), info.value
    reader = Sandbox.create("base", volume_mounts={"/r": f"{vol.name}:ro"}, timeout=120)
    kills.append(reader)
    writer.files.write("/w/live.txt", "written while the reader runs")
    assert reader.files.read("/r/live.txt") == "written while the reader runs"
    with pytest.raises(CommandExitException) as refused:
        reader.commands.run("echo x > /r/new.txt", user="root")
    assert "Read-only file system" in refused.value.stderr, refused.value.stderr
    with pytest.raises(CommandExitException):  # no way to lift it from inside: ns refuses the remount,
        # vm's guest may remount its own view, but the host's bind under QEMU stays read-only
        reader.commands.run("mount -o remount,rw /r; echo x > /r/new2.txt", user="root")
    assert not vol.exists("/new.txt") and not vol.exists("/new2.txt")
    with pytest.raises(VolumeException):
        Volume.destroy(vol.volume_id)  # mounted: 409
    writer.kill()
    reader.kill()
    assert Volume.destroy(vol.volume_id) is True


def _kill_9_and_restart(vserver: Running, runtime_name: str) -> None:
    old = vserver.srv
    os.kill(old.proc.pid, signal.SIGKILL)
    old.proc.wait(timeout=30)
    port = int(old.url.rsplit(":", 1)[1])
    vserver.srv = start_server(Path(old.state_dir).parent, runtime_name, vserver.extra, port=port)


def test_a_running_sandbox_keeps_its_volume_across_kill_9(env: Server, vserver: Running, kills: list[Sandbox],
                                                          runtime_name: str) -> None:
    """A sandbox running with a volume when the server is SIGKILLed is adopted with its mount: it
    reads and writes on, the one-writer rule still holds, and its kill leaves no bind behind (vm:
    its 9p export under <state>/vm/exports/ is taken apart)."""
    vol = Volume.create(_name())
    live = Sandbox.create("base", volume_mounts={"/data": vol}, timeout=120)
    kills.append(live)
    live.files.write("/data/before.txt", "before the crash")
    _kill_9_and_restart(vserver, runtime_name)
    assert live.files.read("/data/before.txt") == "before the crash"
    live.files.write("/data/after.txt", "after the restart")
    assert vol.read_file("/after.txt") == "after the restart"
    with pytest.raises(SandboxException) as second:
        kills.append(Sandbox.create("base", volume_mounts={"/w": vol}, timeout=120))
    assert live.sandbox_id in str(second.value), second.value
    exports = vserver.srv.state_dir / "vm" / "exports"
    if runtime_name == "vm":
        assert (exports / live.sandbox_id / "vol-0").is_dir()
    live.kill()
    assert not (exports / live.sandbox_id).exists()
    assert vol.read_file("/before.txt") == "before the crash"
    Volume.destroy(vol.volume_id)


def test_a_volume_stops_at_its_size(env: Server, kills: list[Sandbox]) -> None:
    """``volume_size_mb`` holds inside the sandbox (ns: the bind; vm: through QEMU's 9p export):
    writes past it fail with EDQUOT, what fits stays, and the volume is usable again once freed."""
    caps = httpx.get(f"{env.url}/aenv/info", timeout=10).json()["capabilities"]
    quota = caps.get("disk quota (volumes)", caps.get("disk quota", ""))
    if "unavailable" in quota or not quota:
        pytest.skip(f"no disk quota on this host: {quota}")
    vol = Volume.create(_name())
    sbx = Sandbox.create("base", volume_mounts={"/data": vol}, timeout=120)
    kills.append(sbx)
    with pytest.raises(CommandExitException) as full:
        sbx.commands.run(f"dd if=/dev/zero of=/data/big bs=1M count={VOLUME_MB + 16} conv=fsync", timeout=300)
    assert "quota exceeded" in full.value.stderr.lower(), full.value.stderr
    size = vol.get_info("/big").size
    assert 0 < size <= VOLUME_MB << 20
    sbx.commands.run("rm /data/big && sync")
    sbx.commands.run("dd if=/dev/zero of=/data/small bs=1M count=8 conv=fsync")
    assert vol.get_info("/small").size == 8 << 20
    sbx.kill()
    Volume.destroy(vol.volume_id)


def test_volumes_survive_kill_9(env: Server, vserver: Running, kills: list[Sandbox], runtime_name: str) -> None:
    vol = Volume.create(_name())
    sbx = Sandbox.create("base", volume_mounts={"/data": vol}, timeout=120)
    sbx.commands.run("head -c 300000 /dev/urandom > /data/blob && sha256sum /data/blob > /data/blob.sum")
    digest = sbx.commands.run("cat /data/blob.sum").stdout.split()[0]
    sbx.kill()  # no sandbox runs across this crash (the test above has one)
    _kill_9_and_restart(vserver, runtime_name)
    assert Volume.get_info(vol.volume_id).token == vol.token
    assert vol.read_file("/blob.sum").split()[0] == digest
    again = Sandbox.create("base", volume_mounts={"/v": vol.name}, timeout=120)
    kills.append(again)
    assert again.commands.run("sha256sum /v/blob").stdout.split()[0] == digest
    again.kill()
    Volume.destroy(vol.volume_id)


criu_suite = pytest.mark.criu
needs_criu = pytest.mark.skipif(not CRIU.usable, reason=f"CRIU >= 4.2 absent ({CRIU.reason})")


def _alive(sbx: Sandbox, pid: int) -> bool:
    return sbx.commands.run(f"kill -0 {pid} && echo yes || echo no").stdout.strip() == "yes"


@criu_suite
@needs_criu
def test_fork_keeps_processes_and_shares_the_volume(env: Server, vserver: Running, kills: list[Sandbox],
                                                    ns_only: None) -> None:
    """A process fork of a sandbox with a volume: the volume is external to the images (shared, not
    copied), the child mounts it read-only where the parent had it, a process whose cwd and open
    file are on the volume comes back; in a user namespace too (the restore binds an idmapped clone
    of the volume that host root staged for CRIU)."""
    vol = Volume.create(_name())
    parent = Sandbox.create("base", volume_mounts={"/data": vol}, timeout=120)
    kills.append(parent)
    parent.files.write("/data/a.txt", "before the fork")
    keeper = parent.commands.run("cd /data && exec 3</data/a.txt && exec sleep 100000", background=True, timeout=0)
    keeper.disconnect()
    results = parent.fork(count=2)
    children = [c for c in results if not isinstance(c, Exception)]
    kills.extend(children)
    assert len(children) == 2, results
    parent.files.write("/data/b.txt", "after the fork")  # the writer writes on
    for child in children:
        assert _alive(child, keeper.pid)  # processes came back: a process (full) fork
        assert child.files.read("/data/a.txt") == "before the fork"
        assert child.files.read("/data/b.txt") == "after the fork"  # the same volume, not a copy
        with pytest.raises(CommandExitException) as refused:
            child.commands.run("touch /data/child.txt", user="root")
        assert "Read-only file system" in refused.value.stderr
    for s in (*children, parent):
        s.kill()
    Volume.destroy(vol.volume_id)


@criu_suite
@needs_criu
def test_a_released_pause_resumes_with_its_volume(env: Server, vserver: Running, kills: list[Sandbox],
                                                  ns_only: None) -> None:
    """Paused and released (CRIU dump to disk, processes ended: ``AENV_NS_RELEASE_PAUSED_AFTER=0``),
    then resumed: the processes and the read-write volume are back."""
    vol = Volume.create(_name())
    sbx = Sandbox.create("base", volume_mounts={"/data": vol}, timeout=120)
    kills.append(sbx)
    keeper = sbx.commands.run("cd /data && exec sleep 100000", background=True, timeout=0)
    keeper.disconnect()
    sbx.pause()
    root = env.state_dir / "sandboxes" / sbx.sandbox_id / "ns" / "released" / "released.json"
    deadline = time.monotonic() + 60
    while not root.exists():
        assert time.monotonic() < deadline, "the paused sandbox was not released"
        time.sleep(0.2)
    vol.write_file("/while-paused.txt", "written while it was released")
    sbx.connect()
    assert _alive(sbx, keeper.pid)
    assert sbx.files.read("/data/while-paused.txt") == "written while it was released"
    sbx.files.write("/data/after.txt", "still read-write")
    assert vol.read_file("/after.txt") == "still read-write"
    sbx.kill()
    Volume.destroy(vol.volume_id)


def test_a_files_only_pause_cold_starts_with_its_volume(env: Server, kills: list[Sandbox]) -> None:
    vol = Volume.create(_name())
    sbx = Sandbox.create("base", volume_mounts={"/data": vol}, timeout=120)
    kills.append(sbx)
    sbx.files.write("/data/kept.txt", "in the volume")
    sbx.pause(keep_memory=False)  # every process ends; the resume is a cold start on the files
    sbx.connect()
    assert sbx.files.read("/data/kept.txt") == "in the volume"
    sbx.files.write("/data/again.txt", "read-write again")
    assert vol.read_file("/again.txt") == "read-write again"
    # paused again with memory (vm: the cold-booted VM owns its RAM, so it stays in RAM: a save to disk
    # would be a migration, which QEMU refuses while the export is mounted)
    sbx.pause()
    sbx.connect()
    assert sbx.files.read("/data/again.txt") == "read-write again"
    sbx.kill()
    Volume.destroy(vol.volume_id)


def _wait_cwd(sbx: Sandbox, pid: int, path: str) -> None:
    """Until process ``pid`` of ``sbx`` works in ``path`` (a background command has started)."""
    deadline = time.monotonic() + 60
    while sbx.commands.run(f"readlink /proc/{pid}/cwd || true", user="root").stdout.strip() != path:
        assert time.monotonic() < deadline, f"process {pid} did not start in {path}"
        time.sleep(0.1)


def _vm_run_dir(env: Server, sandbox_id: str) -> Path:
    from aenv.runtime.vm.runtime import run_root_for

    return run_root_for(env.state_dir) / sandbox_id


def test_vm_fork_shares_the_volume_read_only(env: Server, kills: list[Sandbox], vm_only: None) -> None:
    """Fork children mount the parent's volume read-only from their own QEMU; the parent writes on.
    While a process of the parent holds the volume, a fork is refused (409) and names it: the guest's
    9p channel takes one mount at a time, and the copy's old mount would still be held there."""
    vol = Volume.create(_name())
    parent = Sandbox.create("base", volume_mounts={"/data": vol}, timeout=120)
    kills.append(parent)
    parent.files.write("/data/a.txt", "before the fork")
    keeper = parent.commands.run("exec sleep 100000", background=True, timeout=0)  # not on the volume
    keeper.disconnect()
    results = parent.fork(count=2)
    children = [c for c in results if not isinstance(c, Exception)]
    kills.extend(children)
    assert len(children) == 2, results
    parent.files.write("/data/b.txt", "after the fork")
    for child in children:
        assert _alive(child, keeper.pid)
        assert child.files.read("/data/a.txt") == "before the fork"
        assert child.files.read("/data/b.txt") == "after the fork"
        with pytest.raises(CommandExitException) as refused:
            child.commands.run("touch /data/child.txt", user="root")
        assert "Read-only file system" in refused.value.stderr
    holder = parent.commands.run("cd /data && exec 3</data/a.txt && exec sleep 100000", background=True, timeout=0)
    _wait_cwd(parent, holder.pid, "/data")
    with pytest.raises(SandboxException) as busy:
        parent.fork(count=1)
    assert "409" in str(busy.value) and f"/proc/{holder.pid}/" in str(busy.value), busy.value
    holder.kill()
    for s in (*children, parent):
        s.kill()
    Volume.destroy(vol.volume_id)


def test_vm_a_released_pause_resumes_with_its_volume(env: Server, kills: list[Sandbox], vm_only: None) -> None:
    """Paused and saved to disk at once (``AENV_VM_RELEASE_PAUSED_AFTER=0``): the resume is a new QEMU,
    and the guest mounts the volume again from it, read-write. A sandbox whose volume is in use when
    it pauses stays in RAM instead (its resume could not mount it again) and resumes as it was."""
    vol = Volume.create(_name())
    sbx = Sandbox.create("base", volume_mounts={"/data": vol}, timeout=120)
    kills.append(sbx)
    keeper = sbx.commands.run("exec sleep 100000", background=True, timeout=0)
    keeper.disconnect()
    sbx.pause()
    assert is_released(_vm_run_dir(env, sbx.sandbox_id))
    vol.write_file("/while-paused.txt", "written while it was released")
    sbx.connect()
    assert _alive(sbx, keeper.pid)
    assert sbx.files.read("/data/while-paused.txt") == "written while it was released"
    sbx.files.write("/data/after.txt", "still read-write")
    assert vol.read_file("/after.txt") == "still read-write"
    holder = sbx.commands.run("cd /data && exec sleep 100000", background=True, timeout=0)
    _wait_cwd(sbx, holder.pid, "/data")
    sbx.pause()
    assert not is_released(_vm_run_dir(env, sbx.sandbox_id))  # kept in RAM: the release runs inside pause
    sbx.connect()
    assert _alive(sbx, holder.pid) and sbx.files.read("/data/after.txt") == "still read-write"
    sbx.kill()
    Volume.destroy(vol.volume_id)


def test_vm_a_snapshot_restores_with_the_mounts_its_create_asks(env: Server, kills: list[Sandbox],
                                                                vm_only: None) -> None:
    """A snapshot carries no volume: a create from it mounts what it asks, and the guest's mount
    of the snapshot's source (of a QEMU that is gone) is taken away."""
    vol, other = Volume.create(_name()), Volume.create(_name())
    src = Sandbox.create("base", volume_mounts={"/data": vol}, timeout=120)
    kills.append(src)
    src.files.write("/data/src.txt", "the source's volume")
    other.write_file("/other.txt", "another volume")
    snap = src.create_snapshot()
    again = Sandbox.create(snap.snapshot_id, volume_mounts={"/data": other}, timeout=120)
    kills.append(again)
    assert again.files.read("/data/other.txt") == "another volume"
    assert not again.files.exists("/data/src.txt")
    bare = Sandbox.create(snap.snapshot_id, timeout=120)
    kills.append(bare)
    assert "9p" not in bare.commands.run("cat /proc/mounts").stdout
    for s in (bare, again, src):
        s.kill()
    Volume.destroy(vol.volume_id)
    Volume.destroy(other.volume_id)

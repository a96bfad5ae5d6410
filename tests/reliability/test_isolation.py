"""Isolation, proven from inside a sandbox through the real SDK.

Each test plants something on the host (a file, a listening socket, a process, another sandbox) and
shows the sandbox cannot see or reach it, or drives a sandbox into its own limits (memory, pids, disk)
and shows the server and a neighbour sandbox keep serving. Commands run as root inside the sandbox
where that makes the attempt stronger: isolation must not depend on the sandbox user being unprivileged.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import CommandExitException, Sandbox

from aenv.runtime.ns import disk
from aenv.testing.server import API_KEY, Server
from tests.fixtures.nethost import HostListener, host_addrs
from tests.reliability.helpers import ServerFactory, sdk_kwargs

PIDS_LIMIT = 300
DISK_MB = 256
MEMORY_MB = 128


@pytest.fixture(scope="module")
def iso_server(tmp_path_factory: pytest.TempPathFactory, runtime_name: str) -> Iterator[Server]:
    if os.geteuid() != 0:
        pytest.skip("the ns and vm runtimes need root")
    factory = ServerFactory(
        tmp_path_factory.mktemp("aenv-iso"), runtime_name,
        {"AENV_POOL_SIZE": "0", "AENV_PIDS_LIMIT": str(PIDS_LIMIT), "AENV_DEFAULT_DISK_MB": str(DISK_MB)},
    )
    try:
        yield factory.start()
    finally:
        factory.close()


@pytest.fixture(scope="module")
def iso(iso_server: Server) -> dict[str, str]:
    return sdk_kwargs(iso_server)


@pytest.fixture
def sbx(iso: dict[str, str]) -> Iterator[Sandbox]:
    s = Sandbox.create("base", timeout=600, **iso)
    yield s
    s.kill()


@pytest.fixture
def neighbour(iso: dict[str, str]) -> Iterator[Sandbox]:
    s = Sandbox.create("base", timeout=600, **iso)
    yield s
    s.kill()


def root(s: Sandbox, cmd: str, timeout: float = 60) -> str:
    """Run as root; return stdout whatever the exit code (the probes often fail on purpose)."""
    try:
        return s.commands.run(cmd, user="root", timeout=timeout).stdout
    except CommandExitException as exc:
        return exc.stdout


def test_host_files_invisible(sbx: Sandbox, tmp_path: Path) -> None:
    name = f"host-marker-{secrets.token_hex(6)}"
    secret = secrets.token_hex(16)
    (tmp_path / name).write_text(secret)
    paths = [tmp_path / name, Path("/proc/1/root") / str(tmp_path / name).lstrip("/"),
             Path("/proc/self/root") / str(tmp_path / name).lstrip("/")]
    out = root(sbx, "; ".join(f"cat {p} 2>/dev/null" for p in paths) + f"; find / -xdev -name {name} 2>/dev/null")
    assert secret not in out and name not in out
    with pytest.raises(Exception):  # noqa: B017 - NotFound, whatever the SDK version calls it
        sbx.files.read(str(tmp_path / name))


def test_host_processes_invisible(sbx: Sandbox) -> None:
    out = root(sbx, "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done")
    cmdlines = [line for line in out.splitlines() if line.strip()]
    assert cmdlines and len(cmdlines) < 20, cmdlines
    for line in cmdlines:
        assert "pytest" not in line and "aenv.cli.main serve" not in line and "slirp4netns" not in line, line


def test_state_dir_unreachable(sbx: Sandbox, iso_server: Server) -> None:
    state = iso_server.state_dir
    out = root(sbx, f"ls -la {state} 2>&1; ls {state}/sandboxes 2>&1; find / -xdev -name aenv.db 2>/dev/null; "
                    f"ls -la /.aenv-run 2>&1")
    assert "aenv.db" not in out
    assert sbx.sandbox_id not in out.replace(f"{state}/sandboxes", "")  # no listing of the sandboxes dir
    assert "No such file or directory" in out


def test_other_sandbox_invisible(sbx: Sandbox, neighbour: Sandbox) -> None:
    secret = secrets.token_hex(16)
    name = f"neighbour-{secrets.token_hex(4)}"
    neighbour.files.write(f"/home/user/{name}", secret)
    neighbour.commands.run("sleep 100123", background=True, timeout=0).disconnect()
    assert name not in root(sbx, f"find / -xdev -name '{name}' 2>/dev/null")
    assert "sleep 100123" not in root(sbx, "ps -eo args")
    assert secret not in root(sbx, f"cat /home/user/{name} /proc/*/root/home/user/{name} 2>/dev/null")
    assert not sbx.files.exists(f"/home/user/{name}")


def test_host_device_nodes_not_writable_as_inodes(sbx: Sandbox) -> None:
    """/dev/null & co. are the host's own inodes bind-mounted in; sandbox root must not be able to
    chmod/chown/touch them (that would change the host's /dev/null), while I/O keeps working."""
    before = os.stat("/dev/null")
    out = root(sbx, "touch -m -d '2001-02-03' /dev/null 2>&1; chmod 0600 /dev/null 2>&1; "
                    "chown 1000 /dev/null 2>&1; echo data > /dev/null && echo write-ok; "
                    "head -c 8 /dev/urandom | wc -c")
    after = os.stat("/dev/null")
    if (after.st_mtime, after.st_mode, after.st_uid) != (before.st_mtime, before.st_mode, before.st_uid):
        os.utime("/dev/null", (before.st_atime, before.st_mtime))  # undo before failing
        os.chmod("/dev/null", before.st_mode & 0o7777)
        os.chown("/dev/null", before.st_uid, before.st_gid)
        pytest.fail(f"sandbox root changed the host's /dev/null: {out}")
    assert "write-ok" in out and out.split()[-1] == "8"


@pytest.mark.parametrize("internet", [True, False], ids=["internet", "offline"])
def test_host_loopback_and_addresses_unreachable(iso: dict[str, str], internet: bool) -> None:
    addrs = host_addrs()
    listener = HostListener(addrs)
    s = Sandbox.create("base", timeout=300, allow_internet_access=internet, **iso)
    try:
        # a sanity check that the listener works at all, from the host itself
        with socket.create_connection(("127.0.0.1", listener.port), timeout=5):
            pass
        deadline = time.monotonic() + 5
        while listener.accepted < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert listener.accepted == 1
        targets = [*addrs, "10.0.2.2", "localhost"]
        probe = "; ".join(
            f"timeout 3 bash -c 'echo x > /dev/tcp/{t}/{listener.port}' 2>/dev/null && echo OPEN:{t}" for t in targets
        )
        out = root(s, probe)
        assert "OPEN" not in out, out
        assert listener.accepted == 1, "a sandbox connection reached the host listener"
    finally:
        s.kill()
        listener.close()


def _still_serving(server: Server, other: Sandbox) -> None:
    assert httpx.get(server.url + "/health", trust_env=False, timeout=10).status_code == 200
    assert other.commands.run("echo neighbour-ok").stdout.strip() == "neighbour-ok"


def test_memory_bomb_is_contained(iso: dict[str, str], iso_server: Server, neighbour: Sandbox) -> None:
    s = Sandbox.create("base", timeout=300, **iso, **{"metadata": {"t": "membomb"}})
    try:
        # the SDK has no per-sandbox memory knob: aenv accepts memoryMB on create (extension)
        # (a long timeout: on vm a new memory size means a template built for that shape first)
        with httpx.Client(base_url=iso_server.url, headers={"X-API-KEY": iso["api_key"]}, trust_env=False,
                          timeout=300) as c:
            small = c.post("/v2/sandboxes", json={"templateID": "base", "memoryMB": MEMORY_MB, "timeout": 300})
        assert small.status_code == 201, small.text
        bomb = Sandbox.connect(small.json()["sandboxID"], **iso)
        try:
            with pytest.raises(CommandExitException) as exc:
                bomb.commands.run("python3 -c 'a = []\nwhile True: a.append(bytearray(10**7))'", timeout=120)
            assert exc.value.exit_code != 0
            _still_serving(iso_server, neighbour)
            assert bomb.commands.run("echo survived").stdout.strip() == "survived"
            assert s.commands.run("echo ok").stdout.strip() == "ok"
        finally:
            bomb.kill()
    finally:
        s.kill()


def test_fork_bomb_hits_pids_limit(sbx: Sandbox, iso_server: Server, neighbour: Sandbox) -> None:
    # Every child sleeps and exits by itself, so the sandbox recovers without anyone having to fork a kill.
    # (bash retries a failed fork with back-off, so a few dozen iterations past the limit are enough)
    h = sbx.commands.run(
        f"for i in $(seq {PIDS_LIMIT + 30}); do sleep 8 & done 2>/tmp/bomb.err; wait; echo bomb-done",
        background=True, timeout=0,
    )
    time.sleep(3)
    _still_serving(iso_server, neighbour)
    try:
        h.wait()
    except CommandExitException:
        pass  # the bomb's own exit status does not matter, only that it was stopped
    deadline = time.monotonic() + 60
    while True:
        try:
            out = sbx.commands.run("grep -c -i 'resource temporarily unavailable\\|retry' /tmp/bomb.err; "
                                   "ls -d /proc/[0-9]* | wc -l", timeout=20).stdout.split()
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    assert int(out[0]) > 0, "the fork bomb never hit a limit"
    assert int(out[1]) < PIDS_LIMIT


def _disk_quota(server: Server) -> str:
    with httpx.Client(base_url=server.url, headers={"X-API-KEY": API_KEY}, trust_env=False) as c:
        return str(c.get("/aenv/info").json().get("capabilities", {}).get("disk quota", "unknown"))


def _allocated(path: Path) -> int:
    return path.stat().st_blocks * 512


def test_disk_writes_bounded(iso: dict[str, str], iso_server: Server, neighbour: Sandbox, runtime_name: str) -> None:
    if runtime_name != "ns":
        s = Sandbox.create("base", timeout=600, **iso)
        try:
            out = root(s, f"dd if=/dev/zero of=/home/user/fill bs=1M count={DISK_MB * 2} 2>&1; echo rc=$?; "
                          "du -sm /home/user/fill; rm -f /home/user/fill", timeout=300)
        finally:
            s.kill()
        written_mb = int(out.strip().splitlines()[-1].split()[0]) if out.strip() else 0
        if "No space left" not in out and written_mb >= DISK_MB * 2:
            pytest.xfail(f"the {runtime_name} runtime has no per-sandbox disk quota: "
                         f"wrote {written_mb} MiB with disk_mb={DISK_MB}")
        assert "No space left" in out and written_mb <= DISK_MB + 16, out
        return

    # ns: each sandbox root is a btrfs subvolume limited to its disk size (aenv.runtime.ns.disk)
    quota = _disk_quota(iso_server)
    if quota.startswith("unavailable"):
        pytest.skip(f"ns disk quota: {quota}")
    image = iso_server.state_dir / disk.IMAGE_NAME
    s = Sandbox.create("base", timeout=600, **iso)
    ns_root = iso_server.state_dir / "sandboxes" / s.sandbox_id / "ns"
    subvol, fs = disk.subvolume_id(ns_root), disk.fs_uuid(ns_root)
    assert subvol is not None and fs is not None, f"{ns_root} is not a quota subvolume ({quota})"
    try:
        root(s, "head -c 20M /dev/urandom > /home/user/keep && sha256sum /home/user/keep > /home/user/keep.sum")
        before = _allocated(image) if image.exists() else 0
        out = root(s, f"dd if=/dev/zero of=/home/user/fill bs=1M count={DISK_MB * 2} conv=fsync 2>&1; "
                      "echo rc=$?; du -sm /home/user/fill", timeout=300)
        written_mb = int(out.strip().splitlines()[-1].split()[0])
        # a clean failure inside the sandbox, at the limit
        assert "Disk quota exceeded" in out or "No space left" in out, out
        assert "rc=0" not in out and written_mb <= DISK_MB, out
        # what was written before is intact; the sandbox keeps working and can free space again
        assert "keep: OK" in root(s, "cd /home/user && sha256sum -c keep.sum")
        # the host disk took at most the quota (the image is sparse; the file never got 2x DISK_MB)
        os.sync()  # qgroup numbers move at transaction commit
        if image.exists():
            assert _allocated(image) - before < (DISK_MB + 64) << 20
        used = disk.qgroup_referenced(fs, subvol)
        assert used is not None and (DISK_MB - 48) << 20 <= used <= DISK_MB << 20, used
        assert root(s, "rm /home/user/fill && echo again > /home/user/after && cat /home/user/after").strip() == "again"
        # the neighbour and the server never noticed
        neighbour.files.write("/home/user/n.txt", "still writing")
        assert neighbour.files.read("/home/user/n.txt") == "still writing"
        _still_serving(iso_server, neighbour)
    finally:
        s.kill()
    # deleting the sandbox drops its subvolume; the btrfs cleaner frees it and its qgroup goes
    assert not ns_root.exists()
    deadline = time.monotonic() + 90
    while (left := disk.qgroup_referenced(fs, subvol)) not in (None, 0):
        assert time.monotonic() < deadline, f"qgroup 0/{subvol} still holds {left} bytes"
        os.sync()
        time.sleep(1)

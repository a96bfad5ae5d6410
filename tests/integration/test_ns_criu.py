"""Process snapshots on ns (CRIU >= 4.2, built by the set-up): the unmodified e2b SDK against a real server.

A parent runs a Python process with in-memory state (a counter, a random number, 8 MB of RAM) and a
TCP listener on 127.0.0.1; fork(count=16) must give 16 children in which that process runs on from
the snapshot (same random number, counter moving, listener answering) while each child has its own
boot id and kernel randomness. A process CRIU cannot dump fails the snapshot with CRIU's reason and
the source runs on. Pause keeps processes across a server restart; rollback brings them back to the
snapshot. These skip only where CRIU is really absent (the set-up builds it; a skip in CI is a
failure to investigate). No wall-clock assertions.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aenv.testing.server import API_KEY, KEEP_SANDBOXES, Server, start_server, stop_server
from tests.fixtures.criu import NS_CRIU_SUITE

pytestmark = NS_CRIU_SUITE

WORKER = """\
import os, random, socket, threading, time
secret = random.random()
ballast = bytearray(8 << 20)
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 8080))
srv.listen()
def serve():
    while True:
        c, _ = srv.accept()
        c.sendall(f"{secret}\\n".encode())
        c.close()
threading.Thread(target=serve, daemon=True).start()
i = 0
while True:
    i += 1
    with open("/tmp/state.tmp", "w") as f:  # replaced whole: a reader never sees it truncated
        f.write(f"{i} {secret}")
    os.replace("/tmp/state.tmp", "/tmp/state")
    time.sleep(0.05)
"""
PROBE = ("python3 -c \"import socket; s=socket.create_connection(('127.0.0.1', 8080)); print(s.recv(64).decode().strip())\"; "
         "cat /tmp/state; echo; cat /proc/sys/kernel/random/boot_id; head -c 8 /dev/urandom | od -An -tx1 | tr -d ' '")


@pytest.fixture
def owned(e2b_env: dict[str, str]) -> Iterator[list[str]]:
    ids: list[str] = []
    yield ids
    from e2b import Sandbox

    for sid in ids:
        try:
            Sandbox.kill(sid)
        except Exception:
            pass


def start_worker(sbx: Any) -> str:
    sbx.files.write("/tmp/worker.py", WORKER)
    sbx.commands.run("python3 /tmp/worker.py", background=True)
    for _ in range(100):
        out = sbx.commands.run("cat /tmp/state 2>/dev/null; true").stdout
        if out:
            return str(out.split()[1])
        time.sleep(0.05)
    raise AssertionError("worker did not start")


def probe(sbx: Any) -> list[str]:
    return [str(x) for x in sbx.commands.run(PROBE).stdout.split()]


def test_fork_16_children_run_the_parents_process(server: Server, owned: list[str]) -> None:
    from e2b import Sandbox

    from aenv.client import AenvClient

    parent = Sandbox.create("base", timeout=600)
    owned.append(parent.sandbox_id)
    secret = start_worker(parent)
    with AenvClient(server.url, API_KEY, timeout=300) as client:
        result = client.fork(parent.sandbox_id, 16)
    owned.extend(result.sandbox_ids)
    assert result.mode == "full" and result.errors == [] and len(result.sandbox_ids) == 16
    seen_boot, seen_random = set(), set()
    for sid in result.sandbox_ids:
        child = Sandbox.connect(sid)
        answer, count, state_secret, boot_id, rnd = probe(child)
        assert answer == state_secret == secret  # the process, its memory and its listener came along
        later = child.commands.run("sleep 0.2; cat /tmp/state").stdout.split()
        assert int(later[0]) > int(count)  # and it runs on
        seen_boot.add(boot_id)
        seen_random.add(rnd)
        assert child.commands.run("hostname").stdout.strip() == sid  # its own name, not the parent's
    assert parent.commands.run("hostname").stdout.strip() == parent.sandbox_id
    parent_probe = probe(parent)
    assert parent_probe[0] == secret
    seen_boot.add(parent_probe[3])
    assert len(seen_boot) == 17 and len(seen_random) == 16


def test_undumpable_process_fails_explicitly_and_source_runs_on(server: Server, owned: list[str]) -> None:
    """io_uring cannot be dumped by CRIU: the snapshot is a 409 that says so, not a filesystem snapshot."""
    from e2b import Sandbox
    from e2b.exceptions import SandboxException

    sbx = Sandbox.create("base", timeout=600)
    owned.append(sbx.sandbox_id)
    sbx.commands.run("python3 -c \"import ctypes, time; p = ctypes.create_string_buffer(120); "
                     "assert ctypes.CDLL(None).syscall(425, 4, p) >= 0; open('/tmp/ring', 'w').close(); "
                     "time.sleep(3600)\"", background=True)
    for _ in range(100):
        if sbx.files.exists("/tmp/ring"):
            break
        time.sleep(0.05)
    with pytest.raises(SandboxException, match=r"409.*its processes cannot be snapshotted: criu dump failed: .*pid"):
        sbx.create_snapshot()
    assert sbx.commands.run("echo alive").stdout == "alive\n"
    assert "syscall(425" in sbx.commands.run("ps -eo args").stdout
    assert Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items() == []


def test_rollback_brings_processes_back(server: Server, owned: list[str]) -> None:
    from e2b import Sandbox

    from aenv.client import AenvClient

    sbx = Sandbox.create("base", timeout=600)
    owned.append(sbx.sandbox_id)
    secret = start_worker(sbx)
    snap = sbx.create_snapshot().snapshot_id
    sbx.commands.run("pkill -f '[w]orker.py'; echo later > /tmp/later", user="root")
    with AenvClient(server.url, API_KEY, timeout=300) as client:
        client.rollback(sbx.sandbox_id, snap)
    assert probe(sbx)[0] == secret
    assert sbx.commands.run("test -e /tmp/later || echo gone").stdout == "gone\n"
    # CRIU restores the host bind mounts writable; ro_remount.py makes them read-only again before the
    # restored tree resumes: sandbox root must not touch the host's /dev/null or the shared tools
    # (in a user namespace, ns_userns_uid, the host-owned boot id file is refused before: EACCES)
    for attempt in ("touch -m /dev/null", "touch /.aenv/x", "touch /proc/sys/kernel/random/boot_id"):
        out = sbx.commands.run(f"{attempt} 2>&1; echo rc=$?", user="root").stdout
        refused = "Read-only file system" in out or ("boot_id" in attempt and "Permission denied" in out)
        assert refused and out.endswith("rc=1\n"), (attempt, out)
    mounts = [line.split() for line in sbx.commands.run("cat /proc/self/mountinfo").stdout.splitlines()]
    for point in ("/dev/null", "/.aenv", "/proc/sys/kernel/random/boot_id"):
        assert next(f[5] for f in mounts if f[4] == point).split(",")[0] == "ro", point


def test_pause_restart_resume_keeps_processes(tmp_path: Path, e2b_env: dict[str, str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from e2b import Sandbox

    srv = start_server(tmp_path, "ns", extra_env={"AENV_POOL_SIZE": "0", **KEEP_SANDBOXES})
    try:
        for k in ("E2B_API_URL", "E2B_SANDBOX_URL"):
            monkeypatch.setenv(k, srv.url)
        sbx = Sandbox.create("base", timeout=600)
        secret = start_worker(sbx)
        sbx.pause()
        port = int(srv.url.rsplit(":", 1)[1])
        stop_server(srv)
        srv = start_server(tmp_path, "ns", extra_env={"AENV_POOL_SIZE": "0", **KEEP_SANDBOXES}, port=port)
        again = Sandbox.connect(sbx.sandbox_id, timeout=600)
        before = again.commands.run("cat /tmp/state").stdout.split()
        assert before[1] == secret and probe(again)[0] == secret
        assert int(again.commands.run("sleep 0.2; cat /tmp/state").stdout.split()[0]) > int(before[0])
        again.kill()
    finally:
        stop_server(srv)


def test_start_from_the_templates_process_image_can_be_forked(server: Server, owned: list[str]) -> None:
    """A start the pool cannot serve (here: from a filesystem snapshot) restores the template's process
    image once one is made (procimage.py): it has the snapshot's files, the sandbox's own identity, and
    it can be forked with its processes, which a zygote-started sandbox could not."""
    from e2b import Sandbox

    from aenv.client import AenvClient

    src = Sandbox.create("base", timeout=600)
    owned.append(src.sandbox_id)
    src.files.write("/home/user/mark", "from-the-snapshot")
    with AenvClient(server.url, API_KEY, timeout=300) as client:
        snap = client.snapshot(src.sandbox_id, mode="filesystem").snapshot_id
        client.wait_written(snap)
        first = Sandbox.create(snap, timeout=600)  # a miss: started by exec, the image is made meanwhile
        owned.append(first.sandbox_id)
        deadline = time.monotonic() + 120
        while "process image of template" not in server.log_tail(400) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "process image of template" in server.log_tail(400), server.log_tail(60)
        sbx = Sandbox.create(snap, timeout=600)
        owned.append(sbx.sandbox_id)
        assert sbx.files.read("/home/user/mark") == "from-the-snapshot"
        assert sbx.commands.run("echo $E2B_SANDBOX_ID; hostname").stdout.split() == [sbx.sandbox_id] * 2
        boot = sbx.commands.run("cat /proc/sys/kernel/random/boot_id").stdout
        assert boot != first.commands.run("cat /proc/sys/kernel/random/boot_id").stdout
        secret = start_worker(sbx)
        result = client.fork(sbx.sandbox_id, 2)
    owned.extend(result.sandbox_ids)
    assert result.mode == "full" and len(result.sandbox_ids) == 2
    for sid in result.sandbox_ids:
        assert probe(Sandbox.connect(sid))[0] == secret
    # the pool refills from the image too: hand-outs of restored pool entries are sandboxes like any other
    pool = server.state_dir / "sandboxes" / ".ns-pool"
    deadline = time.monotonic() + 60
    while not list(pool.glob("pool-*/run/restore.log")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert list(pool.glob("pool-*/run/restore.log")), "no pool entry was restored from the image"
    for _ in range(3):
        pooled = Sandbox.create("base", timeout=600)
        owned.append(pooled.sandbox_id)
        assert pooled.commands.run("hostname; whoami").stdout.split() == [pooled.sandbox_id, "user"]


def test_a_debug_logging_servers_sandboxes_fork_and_start_from_the_process_image(tmp_path: Path) -> None:
    """With ``log_level = debug`` every sandbox process keeps ``/.aenv-run/agent.log`` open; restores
    map that external mount to the new sandbox's run dir, where CRIU needs the file as dumped (it
    failed "Can't open file .aenv-run/agent.log", and every fork of such a server with it)."""
    from e2b import Sandbox

    srv = start_server(tmp_path, "ns", {"AENV_LOG_LEVEL": "debug", "AENV_POOL_SIZE": "1"})
    try:
        conn = {"api_url": srv.url, "sandbox_url": srv.url, "api_key": API_KEY}
        parent = Sandbox.create("base", timeout=300, **conn)  # type: ignore[arg-type]
        parent.commands.run("echo parent-was-here")
        from aenv.client import AenvClient

        with AenvClient(srv.url, API_KEY) as client:
            forked = client.fork(parent.sandbox_id, count=2)
        assert len(forked.sandbox_ids) == 2, forked.errors
        for sid in forked.sandbox_ids:
            assert Sandbox.connect(sid, **conn).commands.run("hostname").stdout.strip() == sid  # type: ignore[arg-type]
        log = srv.log_path.read_text()
        assert "restore of the template's process image failed" not in log
        assert "Can't open file" not in log
    finally:
        stop_server(srv)

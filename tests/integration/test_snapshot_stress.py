"""Full snapshots (CRIU) must not fail because of the sandbox's own plumbing (issue 35).

The bench saw ``criu dump failed: unix: Found a closed in-flight socket`` on a plain idle sandbox
snapshotted right after its create: a connection queued on one of the sandbox's listening unix
sockets (envd's ``envd.sock``, the agent's ``mux.sock``) whose host end was closed before the
process accepted it. CRIU cannot dump such a listener. The server's own connections are what closes
them: the proxy opens an envd stream in the background as a sandbox starts (``UpstreamPool.prewarm``)
and a full snapshot closes every host connection first (``NsSandbox.quiesce``).

``test_200_full_snapshots`` takes 200 full snapshots through the real server and the unmodified e2b
SDK across idle, just-created, busy, socket-using, raced and paused sandboxes, and asserts that none
failed, naming every failure. ``test_connections_closed_before_accept`` makes the bench's condition
on purpose (a paused sandbox, so nothing accepts): the snapshot must succeed anyway. No wall-clock
assertions. ``AENV_STRESS_BENCH_LOOP=N`` adds N rounds of the bench's own case to the first test.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from aenv.testing.server import API_KEY, Server
from tests.fixtures.criu import NS_CRIU_SUITE
from tests.integration.test_ns_snapshots import sandboxes  # noqa: F401 - the fixture: killed after

pytestmark = [*NS_CRIU_SUITE, pytest.mark.slow]

BUSY = """\
import os, threading
def spin():
    x = 0
    while True:
        x = (x * 31 + 7) % 1000003
def write():
    i = 0
    while True:
        i += 1
        with open(f"/tmp/busy-{i % 8}", "wb") as f:
            f.write(os.urandom(65536))
        os.replace(f"/tmp/busy-{i % 8}", f"/tmp/busy-done-{i % 8}")
threading.Thread(target=write, daemon=True).start()
spin()
"""
# A TCP http server hit in a loop from another process, a pipe between two processes and a
# socketpair ping-pong: all of them mid-use at any dump.
SOCKETS = """\
import http.server, os, socket, subprocess, sys, threading, time, urllib.request
srv = http.server.ThreadingHTTPServer(("127.0.0.1", 8081), http.server.SimpleHTTPRequestHandler)
threading.Thread(target=srv.serve_forever, daemon=True).start()
def hit():
    while True:
        try:
            urllib.request.urlopen("http://127.0.0.1:8081/", timeout=5).read()
        except OSError:
            time.sleep(0.01)
threading.Thread(target=hit, daemon=True).start()
a, b = socket.socketpair()
def pong():
    while True:
        b.sendall(b.recv(4096))
threading.Thread(target=pong, daemon=True).start()
cat = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
open("/tmp/sockets-up", "w").close()
while True:
    a.sendall(b"x" * 512)
    a.recv(4096)
    cat.stdin.write(b"y" * 4096)
    cat.stdin.flush()
"""


@dataclass
class Tally:
    """Every full snapshot taken: how many succeeded and each failure's message (all kept)."""

    ok: int = 0
    failures: list[str] = field(default_factory=list)
    per_case: dict[str, list[int]] = field(default_factory=dict)  # case -> [taken, failed]
    lock: threading.Lock = field(default_factory=threading.Lock)

    def snapshot(self, client: Any, sandbox_id: str, case: str,
                 check: Callable[[str], None] | None = None) -> None:
        """One full snapshot, ``check`` of it, then its deletion (the disk must not fill)."""
        snap = None
        try:
            snap = client.snapshot(sandbox_id, mode="full")
            assert snap.mode == "full", snap
            if check is not None:
                check(snap.snapshot_id)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, none stops the run
            self._count(case, f"{case} ({sandbox_id}): {type(exc).__name__}: {exc}")
        else:
            self._count(case)
        if snap is not None:
            delete(client, snap.snapshot_id)

    def _count(self, case: str, failure: str | None = None) -> None:
        with self.lock:
            counts = self.per_case.setdefault(case, [0, 0])
            counts[0] += 1
            if failure is None:
                self.ok += 1
            else:
                counts[1] += 1
                self.failures.append(failure)

    @property
    def taken(self) -> int:
        return self.ok + len(self.failures)

    def report(self) -> str:
        cases = ", ".join(f"{c}: {t} taken, {f} failed" for c, (t, f) in self.per_case.items())
        return f"{self.taken} full snapshots, {len(self.failures)} failed ({cases})" + "".join(
            f"\n  {m}" for m in self.failures)


def delete(client: Any, snapshot_id: str) -> None:
    from aenv.client import ConflictError

    deadline = time.monotonic() + 60
    while True:
        try:
            client.delete_snapshot(snapshot_id)
            return
        except ConflictError:  # its pages are still being linked to the previous one's
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.fixture
def client(server: Server) -> Iterator[Any]:
    from aenv.client import AenvClient

    with AenvClient(server.url, API_KEY, timeout=300) as c:
        yield c


def create(owned: list[Any]) -> Any:
    from e2b import Sandbox

    sbx = Sandbox.create("base", timeout=600)
    owned.append(sbx)
    return sbx


def kill(owned: list[Any], sbx: Any) -> None:
    sbx.kill()
    owned.remove(sbx)


def wait_for(sbx: Any, path: str) -> None:
    for _ in range(200):
        if sbx.commands.run(f"test -e {path} && echo y || true").stdout.strip() == "y":
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


def racing(sbx: Any, calls: list[Callable[[Any], object]], go: threading.Event) -> list[threading.Thread]:
    """Threads that make SDK calls on ``sbx`` until ``go`` is cleared (each its own connections to
    envd through the server, opened and closed around the snapshot)."""
    def loop(call: Callable[[Any], object]) -> None:
        while go.is_set():
            try:
                call(sbx)
            except Exception:  # noqa: BLE001 - a call cut by the dump is allowed; the snapshot is what counts
                time.sleep(0.01)

    threads = [threading.Thread(target=loop, args=(c,), daemon=True) for c in calls]
    for t in threads:
        t.start()
    return threads


def restores_serving(snapshot_id: str) -> None:
    """A sandbox started from the snapshot has the http server of ``SOCKETS`` answering."""
    from e2b import Sandbox

    child = Sandbox.create(snapshot_id, timeout=600)
    try:
        out = child.commands.run("python3 -c \"import urllib.request; "
                                 "print(urllib.request.urlopen('http://127.0.0.1:8081/', timeout=10).status)\"")
        assert out.stdout.strip() == "200", out
    finally:
        child.kill()


def run_racing(tally: Tally, client: Any, sbx: Any, n: int, case: str) -> None:
    calls: list[Callable[[Any], object]] = [
        lambda s: s.commands.run("echo hi"),
        lambda s: s.files.read("/etc/hostname"),
        lambda s: s.files.write("/tmp/racing", "x" * 1000),
        lambda s: s.commands.run("head -c 100000 /dev/urandom > /tmp/r"),
    ]
    go = threading.Event()
    go.set()
    threads = racing(sbx, calls, go)
    try:
        for _ in range(n):
            tally.snapshot(client, sbx.sandbox_id, case)
    finally:
        go.clear()
        for t in threads:
            t.join(60)
    assert sbx.commands.run("echo alive").stdout == "alive\n"


def test_200_full_snapshots(server: Server, client: Any, sandboxes: list[Any]) -> None:  # noqa: F811
    tally, owned = Tally(), sandboxes

    # the bench's case: a fresh sandbox, snapshotted right after its create (the proxy's prewarm of
    # an envd stream is still under way), or after one command
    for i in range(40):
        sbx = create(owned)
        if i % 2:
            sbx.commands.run("head -c 1000000 /dev/urandom > /home/user/dirty")
        tally.snapshot(client, sbx.sandbox_id, "fresh" if i % 2 == 0 else "fresh+write")
        kill(owned, sbx)

    # a fresh sandbox snapshotted while SDK calls race the snapshot call from the first moment
    for _ in range(10):
        sbx = create(owned)
        run_racing(tally, client, sbx, 2, "fresh+racing")
        kill(owned, sbx)

    idle = create(owned)
    for _ in range(20):  # the same idle sandbox, back to back
        tally.snapshot(client, idle.sandbox_id, "idle")
    for i in range(20):  # right after a command / a file read
        if i % 2:
            idle.files.read("/etc/hostname")
        else:
            idle.commands.run("echo hello > /tmp/hello && cat /tmp/hello")
        tally.snapshot(client, idle.sandbox_id, "after-call")
    kill(owned, idle)

    busy = create(owned)
    busy.files.write("/tmp/busy.py", BUSY)
    busy.commands.run("python3 /tmp/busy.py", background=True)
    wait_for(busy, "/tmp/busy-done-0")
    for _ in range(25):
        tally.snapshot(client, busy.sandbox_id, "busy")
    assert busy.commands.run("echo alive").stdout == "alive\n"
    kill(owned, busy)

    sockets = create(owned)
    sockets.files.write("/tmp/sockets.py", SOCKETS)
    sockets.commands.run("python3 /tmp/sockets.py", background=True)
    wait_for(sockets, "/tmp/sockets-up")
    for _ in range(25):  # each restored: a connection skipped in a listener's queue is only reset there
        tally.snapshot(client, sockets.sandbox_id, "sockets", check=restores_serving)
    kill(owned, sockets)

    raced = create(owned)
    run_racing(tally, client, raced, 30, "racing")
    kill(owned, raced)

    paused = create(owned)
    paused.files.write("/tmp/busy.py", BUSY)
    paused.commands.run("python3 /tmp/busy.py", background=True)
    wait_for(paused, "/tmp/busy-done-0")
    from e2b import Sandbox

    for i in range(10):  # paused, snapshotted twice, resumed
        paused.pause()
        tally.snapshot(client, paused.sandbox_id, "paused")
        tally.snapshot(client, paused.sandbox_id, "paused")
        paused = Sandbox.connect(paused.sandbox_id, timeout=600)
        owned[-1] = paused
        assert paused.commands.run(f"echo {i}").stdout == f"{i}\n"
    kill(owned, paused)

    for i in range(int(os.environ.get("AENV_STRESS_BENCH_LOOP", "0"))):  # the bench's case again, N more
        sbx = create(owned)
        if i % 2:
            sbx.commands.run("head -c 1000000 /dev/urandom > /home/user/dirty")
        tally.snapshot(client, sbx.sandbox_id, "bench-loop")
        kill(owned, sbx)

    print(tally.report())
    assert tally.taken >= 200
    assert not tally.failures, tally.report()


def envd_socket(server: Server, sandbox_id: str) -> Path:
    found = [p for p in server.state_dir.rglob("envd.sock") if sandbox_id in p.parts]
    assert len(found) == 1, found
    return found[0]


def test_connections_closed_before_accept(server: Server, client: Any,
                                          sandboxes: list[Any]) -> None:  # noqa: F811
    """Host connections to envd's socket closed before envd accepted them (it is paused: it cannot)
    are left in its listen queue, where CRIU finds them closed and refused the dump; the snapshot
    must succeed anyway, again and again, and the sandbox run on."""
    from e2b import Sandbox

    tally, owned = Tally(), sandboxes
    sbx = create(owned)
    path = envd_socket(server, sbx.sandbox_id)
    for round_ in range(10):
        sbx.pause()
        for _ in range(3):  # what a prewarmed stream closed by the dump leaves behind
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(str(path))
        tally.snapshot(client, sbx.sandbox_id, "paused+closed-in-flight")
        sbx = Sandbox.connect(sbx.sandbox_id, timeout=600)
        owned[-1] = sbx
        for _ in range(3):  # and on a running one, right before the snapshot
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(str(path))
        tally.snapshot(client, sbx.sandbox_id, "running+closed-in-flight")
        assert sbx.commands.run(f"echo {round_}").stdout == f"{round_}\n"
    print(tally.report())
    assert not tally.failures, tally.report()

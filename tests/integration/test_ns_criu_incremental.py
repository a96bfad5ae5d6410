"""Repeated full snapshots of an ns sandbox store only the pages that changed (``runtime/ns/image_links.py``):
a process idle between two snapshots keeps its pages in the first one (CRIU parent references), the
snapshot's JSON says how much, and a sandbox created from the second snapshot, after the first was
deleted, runs that process with its memory. Skips only where CRIU is absent (the set-up builds it)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from aenv.testing.server import API_KEY, Server, start_server, stop_server
from tests.fixtures.criu import NS_CRIU_SUITE

pytestmark = NS_CRIU_SUITE

# 24 MB of distinct pages, then asleep: its pages do not change between two snapshots. SIGUSR1
# makes it hash the 24 MB again, read from whatever memory it was restored with.
IDLE = """\
import hashlib, os, signal, time
ballast = os.urandom(24 << 20)
def check(*_):
    open("/tmp/idle-check", "w").write(hashlib.sha256(ballast).hexdigest())
signal.signal(signal.SIGUSR1, check)
open("/tmp/idle-pid", "w").write(str(os.getpid()))
open("/tmp/idle-ready", "w").write(hashlib.sha256(ballast).hexdigest())
while True:
    time.sleep(86400)
"""
CHECK = ("kill -USR1 $(cat /tmp/idle-pid) && for i in $(seq 100); do [ -s /tmp/idle-check ] && break; "
         "sleep 0.05; done; cat /tmp/idle-check")


def _snapshot(server: Server, sandbox_id: str) -> dict[str, Any]:
    headers = {"X-API-KEY": API_KEY}
    resp = httpx.post(f"{server.url}/sandboxes/{sandbox_id}/snapshots", json={"mode": "full"}, headers=headers,
                      trust_env=False, timeout=120)
    assert resp.status_code in (200, 201), resp.text
    snap_id = resp.json()["snapshotID"]
    for _ in range(600):
        body: dict[str, Any] = httpx.get(f"{server.url}/snapshots/{snap_id}", headers=headers, trust_env=False).json()
        if not body["writing"]:
            return body
        time.sleep(0.05)
    raise AssertionError(f"snapshot {snap_id} still writing")


def _start_idle(sbx: Any) -> str:
    sbx.files.write("/tmp/idle.py", IDLE)
    sbx.commands.run("python3 /tmp/idle.py", background=True)
    for _ in range(200):
        if sbx.commands.run("cat /tmp/idle-ready 2>/dev/null; true").stdout:
            break
        time.sleep(0.05)
    return str(sbx.commands.run("cat /tmp/idle-ready").stdout)


def test_second_full_snapshot_shares_the_idle_process_images(server: Server, e2b_env: dict[str, str]) -> None:
    from e2b import Sandbox

    sbx = Sandbox.create("base", timeout=300)
    made: list[Any] = [sbx]
    try:
        mark = _start_idle(sbx)
        first = _snapshot(server, sbx.sandbox_id)
        assert first["incremental"]["parent"] is None  # the first: nothing to share with
        second = _snapshot(server, sbx.sandbox_id)
        inc = second["incremental"]
        assert inc["parent"] == first["snapshotID"], inc
        assert inc["sharedBytes"] >= 20 << 20 and inc["chain"] == 1, inc  # about the idle ballast
        assert inc["storedBytes"] > 0, inc  # envd and the agent moved
        assert second["sizeBytes"] < first["sizeBytes"] - (16 << 20), (first["sizeBytes"], second["sizeBytes"])
        # the first snapshot may go: the second keeps the shared bytes (links, not references)
        assert httpx.delete(f"{server.url}/templates/{first['snapshotID']}", headers={"X-API-KEY": API_KEY},
                            trust_env=False).status_code in (200, 204)
        child = Sandbox.create(second["snapshotID"], timeout=120)
        made.append(child)
        assert child.commands.run(CHECK).stdout == mark  # its 24 MB, read back from the parent's pages
    finally:
        for s in made:
            try:
                s.kill()
            except Exception:
                pass


def test_a_crash_between_page_switches_leaves_a_usable_snapshot(tmp_path: Path, e2b_env: dict[str, str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL after one process's pagemap went over to parent references and before the others: after a
    restart the snapshot is whole (each process reads either its own pages or the parent's)."""
    from e2b import Sandbox

    env = {"AENV_POOL_SIZE": "0"}
    srv = start_server(tmp_path, "ns", extra_env={**env, "AENV_FAULTS": "ns.snapshot.linked:1"})
    try:
        for k in ("E2B_API_URL", "E2B_SANDBOX_URL"):
            monkeypatch.setenv(k, srv.url)
        sbx = Sandbox.create("base", timeout=600)
        mark = _start_idle(sbx)
        _snapshot(srv, sbx.sandbox_id)
        second = httpx.post(f"{srv.url}/sandboxes/{sbx.sandbox_id}/snapshots", json={"mode": "full"},
                            headers={"X-API-KEY": API_KEY}, trust_env=False, timeout=120).json()["snapshotID"]
        srv.proc.wait(timeout=60)  # the fault point fired in the background linking
        port = int(srv.url.rsplit(":", 1)[1])
        stop_server(srv)
        srv = start_server(tmp_path, "ns", extra_env=env, port=port)
        child = Sandbox.create(second, timeout=120)
        assert child.commands.run(CHECK).stdout == mark
    finally:
        if srv.proc.poll() is None:  # sandboxes outlive their server on purpose: end them first
            for listed in httpx.get(f"{srv.url}/v2/sandboxes", headers={"X-API-KEY": API_KEY},
                                    trust_env=False).json():
                httpx.delete(f"{srv.url}/sandboxes/{listed['sandboxID']}", headers={"X-API-KEY": API_KEY},
                             trust_env=False)
        stop_server(srv)

"""KSM through the unmodified SDK (ns): what a client starts is mergeable from its start, a one-tenant
server's agent and envd once the sandbox is idle (``ksm_idle_s``: not while handed out and working), and a fork
child of a marked sandbox at once (restored by CRIU, which loses the process-wide mark: the agent and
envd set it again); a server with two API keys (two teams) marks nothing (``ksm = auto``:
merged pages are a timing side channel between teams). What ``/aenv/info`` says matches; ksmd rests once merging settled and scans again on a create (``ksm_rest``)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from aenv.client import AenvClient
from aenv.testing.server import API_KEY, Server, start_server, stop_server

OTHER_KEY = "e2b_" + "1" * 40
IDLE_S = 1.0
MARKS = "grep -h ksm_merge /proc/self/ksm_stat /proc/1/ksm_stat"  # a process envd starts, and the sandbox's PID 1


@pytest.fixture(autouse=True)
def _ns_only(runtime_name: str) -> None:
    if runtime_name != "ns":  # (the vm SDK pass; these start ns servers of their own)
        pytest.skip("a vm guest's RAM is marked by QEMU (mem-merge), not its processes: tests/unit/runtime/test_ksm.py")
    if not Path("/proc/self/ksm_stat").exists():
        pytest.skip("this kernel has no per-process KSM (/proc/PID/ksm_stat, Linux >= 6.1)")


def _marks(sbx: Any) -> list[str]:
    return [line.split(":")[1].strip() for line in sbx.commands.run(MARKS, user="root").stdout.splitlines()]


def _envd_marked(srv: Server, sandbox_id: str) -> str:
    """envd's ``ksm_merge_any``, read from the host (asking the sandbox would be work for envd)."""
    from bench.density import ns_pids

    for pid in ns_pids(srv.state_dir, sandbox_id):
        if b"aenv.envd" in Path(f"/proc/{pid}/cmdline").read_bytes():
            for line in Path(f"/proc/{pid}/ksm_stat").read_text().splitlines():
                if line.startswith("ksm_merge_any"):
                    return line.split(":")[1].strip()
    raise AssertionError(f"no envd among the processes of {sandbox_id}")


def _info(srv: Server, key: str = API_KEY) -> dict[str, Any]:
    return httpx.get(srv.url + "/aenv/info", headers={"X-API-KEY": key}, trust_env=False).json()["ksm"]  # type: ignore[no-any-return]


@pytest.fixture
def one_tenant(tmp_path: Path) -> Iterator[Server]:
    """A server with ksm at its default (auto) and one API key (test servers otherwise turn it off)."""
    if os.geteuid() != 0:
        pytest.skip("the ns runtime needs root")
    srv = start_server(tmp_path, "ns", {"AENV_KSM": "auto", "AENV_API_KEYS": API_KEY, "AENV_POOL_SIZE": "1",
                                        "AENV_KSM_IDLE_S": str(IDLE_S)})
    yield srv
    stop_server(srv)


def test_a_one_tenant_server_merges_its_sandboxes_and_their_fork_children(one_tenant: Server) -> None:
    from e2b import Sandbox

    server = one_tenant
    conn = {"api_url": server.url, "sandbox_url": server.url, "api_key": API_KEY}
    sandbox = Sandbox.create("base", timeout=300, **conn)  # type: ignore[arg-type]
    # what a client starts is mergeable from its start (runas --merge); envd, at work, is not marked yet
    assert _marks(sandbox)[:2] == ["yes", "yes"]
    assert _envd_marked(server, sandbox.sandbox_id) == "no"
    time.sleep(IDLE_S + 1.5)  # nothing asked of the sandbox: idle
    assert _envd_marked(server, sandbox.sandbox_id) == "yes"
    assert _marks(sandbox) == ["yes"] * 4  # merge_any and mergeable, both processes
    info = _info(server)
    assert info["merge"] is True and "one tenant" in info["reason"] and info["running"] is True
    assert info["mergeIdleS"] == IDLE_S
    with AenvClient(server.url, API_KEY) as client:
        forked = client.fork(sandbox.sandbox_id, count=1)
    assert forked.sandbox_ids, forked.errors
    child = Sandbox.connect(forked.sandbox_ids[0], **conn)  # type: ignore[arg-type]
    assert _marks(child) == ["yes"] * 4  # its parent was marked: so is the child, with no idle wait
    metrics = httpx.get(server.url + "/metrics", trust_env=False).text
    assert "aenv_ksm_merge 1" in metrics and "aenv_ksm_merged_bytes " in metrics


def _wait_for(srv: Server, what: str, ok: Any, within: float) -> dict[str, Any]:
    deadline = time.monotonic() + within
    while not ok(info := _info(srv)):
        assert time.monotonic() < deadline, f"ksmd not {what} within {within:g} s: {info}"
        time.sleep(0.5)
    return info


def test_ksmd_rests_once_merging_settled_and_scans_again_when_a_sandbox_starts(one_tenant: Server) -> None:
    """``ksm_rest``: nothing new to merge, ksmd stops (merged pages kept); a create starts it again."""
    from e2b import Sandbox

    server = one_tenant
    conn = {"api_url": server.url, "sandbox_url": server.url, "api_key": API_KEY}
    Sandbox.create("base", timeout=300, **conn)  # type: ignore[arg-type]
    # marked after IDLE_S, then three full scans seen by the 5 s metrics rounds
    info = _wait_for(server, "resting", lambda i: i["resting"], 120)
    assert info["rests"] >= 1 and info["running"] is False and "settled" in info["ksmd"]
    assert Path("/sys/kernel/mm/ksm/run").read_text().strip() == "0"  # 0, never 2: merged pages stay merged
    assert "aenv_ksm_resting 1" in httpx.get(server.url + "/metrics", trust_env=False).text
    Sandbox.create("base", timeout=300, **conn)  # type: ignore[arg-type]
    info = _wait_for(server, "woken by the create", lambda i: not i["resting"], 15)  # the next metrics round
    assert info["running"] is True and Path("/sys/kernel/mm/ksm/run").read_text().strip() == "1"


@pytest.fixture
def two_tenants(tmp_path: Path) -> Iterator[Server]:
    if os.geteuid() != 0:
        pytest.skip("the ns runtime needs root")
    srv = start_server(tmp_path, "ns", {"AENV_KSM": "auto", "AENV_API_KEYS": f"{API_KEY},{OTHER_KEY}",
                                        "AENV_POOL_SIZE": "1"})
    yield srv
    stop_server(srv)


def test_two_tenants_are_never_merged(two_tenants: Server) -> None:
    from e2b import Sandbox

    url = two_tenants.url
    sbx = Sandbox.create("base", timeout=300, api_url=url, sandbox_url=url, api_key=OTHER_KEY)
    try:
        assert _marks(sbx) == ["no"] * 4
    finally:
        sbx.kill()
    info = _info(two_tenants, OTHER_KEY)
    assert info["merge"] is False and "2 teams" in info["reason"] and "none across teams" in info["reason"] and "ksmd" not in info

"""Bandwidth limits (``runtime/shaping.py``) against a real server: throughput between a sandbox and a
test host the test makes (``tests/fixtures/throughput.py``), with the server's default limits, a
create's own (aenv's ``bandwidth`` option), a fork child of that sandbox and a sandbox adopted after
a restart. The band is wide on
purpose (a shared 2-core machine; the 10% figure is the bench's, ``python -m bench --scenarios
bandwidth``): these prove the limit is the one set, in each direction, not its precision.
Marked ``sdk``: it runs on vm too (AENV_TEST_RUNTIME=vm)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import Sandbox

from aenv.runtime.network import kill_slirps_serving
from aenv.testing.server import API_KEY, KEEP_SANDBOXES, Server, discard_vm_state, start_server, stop_server
from tests.fixtures.throughput import measure, throughput_host

pytestmark = pytest.mark.sdk

EGRESS, INGRESS = 8.0, 16.0  # the server's defaults, Mbit/s
LOW, HIGH = 0.6, 1.25  # measured / set


@pytest.fixture(scope="module")
def host() -> Iterator[str]:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    from aenv.runtime.shaping import probe

    if (why := probe()) is not None:
        pytest.skip(why)
    with throughput_host() as addr:
        yield addr


@pytest.fixture(scope="module")
def bw_server(tmp_path_factory: pytest.TempPathFactory, runtime_name: str, host: str) -> Iterator[Server]:
    if runtime_name == "vm":
        from aenv.config import Settings
        from aenv.runtime.vm.runtime import unavailable_reason

        if (why := unavailable_reason(Settings())) is not None:
            pytest.skip(f"vm runtime unavailable: {why}")
    srv = start_server(tmp_path_factory.mktemp("aenv-bw"), runtime_name, extra_env={
        "AENV_EGRESS_BANDWIDTH_MBIT": str(EGRESS), "AENV_INGRESS_BANDWIDTH_MBIT": str(INGRESS)})
    keys = ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")
    old = {k: os.environ.get(k) for k in keys}
    os.environ.update({"E2B_API_URL": srv.url, "E2B_SANDBOX_URL": srv.url, "E2B_API_KEY": API_KEY})
    yield srv
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    stop_server(srv)
    discard_vm_state(srv.state_dir)


def _create(srv: Server, **body: Any) -> httpx.Response:
    return httpx.post(f"{srv.url}/sandboxes", json={"templateID": "base", "timeout": 300, **body},
                      headers={"X-API-KEY": API_KEY}, trust_env=False, timeout=120)


def _rate(sbx: Sandbox, host: str, direction: str, mbit: float) -> float:
    """Mbit/s over about 2.5 s at ``mbit``."""
    return measure(sbx, host, direction, int(mbit * 1e6 / 8 * 2.5))


def _within(measured: float, limit: float) -> bool:
    return LOW * limit <= measured <= HIGH * limit


def test_the_server_default_limits_both_directions(bw_server: Server, host: str) -> None:
    sbx = Sandbox.create("base", timeout=300)  # from the pool: shaped with the default when pooled
    try:
        up, down = _rate(sbx, host, "up", EGRESS), _rate(sbx, host, "down", INGRESS)
        assert _within(up, EGRESS), f"egress {up:.1f} Mbit/s, limit {EGRESS}"
        assert _within(down, INGRESS), f"ingress {down:.1f} Mbit/s, limit {INGRESS}"
    finally:
        sbx.kill()


def test_a_create_sets_its_own_and_a_fork_child_keeps_them(bw_server: Server, host: str) -> None:
    bad = _create(bw_server, bandwidth={"egressMbit": 0.01})
    assert bad.status_code == 400 and "bandwidth.egressMbit" in bad.json()["message"]
    answer = _create(bw_server, bandwidth={"egressMbit": 24, "ingressMbit": 0})  # 0: unlimited
    assert answer.status_code == 201, answer.text
    sid = answer.json()["sandboxID"]
    sbx = Sandbox.connect(sid)
    try:
        detail = httpx.get(f"{bw_server.url}/sandboxes/{sid}", headers={"X-API-KEY": API_KEY}, trust_env=False).json()
        assert detail["network"]["bandwidth"] == {"egressMbit": 24.0, "ingressMbit": 0.0}
        up = _rate(sbx, host, "up", 24)
        assert _within(up, 24), f"egress {up:.1f} Mbit/s, limit 24"
        down = _rate(sbx, host, "down", 4 * INGRESS)
        assert down > 2 * INGRESS, f"ingress {down:.1f} Mbit/s: not unlimited (default {INGRESS})"
        children = httpx.post(f"{bw_server.url}/sandboxes/{sid}/fork", json={"count": 1},
                              headers={"X-API-KEY": API_KEY}, trust_env=False, timeout=120)
        assert children.status_code < 300, children.text
        kid = Sandbox.connect(children.json()[0]["sandbox"]["sandboxID"])
        try:
            up = _rate(kid, host, "up", 24)
            assert _within(up, 24), f"the fork child's egress {up:.1f} Mbit/s, limit 24"
        finally:
            kid.kill()
    finally:
        sbx.kill()


def test_limits_hold_after_a_restart(tmp_path: Path, runtime_name: str, host: str,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Sandboxes outlive a server restart and keep their namespace's qdiscs; on ns a slirp4netns that
    died meanwhile is started again by the adoption, and the limits are written again before it attaches
    (``Slirp.start(again=True)``)."""
    if runtime_name == "vm":
        from aenv.config import Settings
        from aenv.runtime.vm.runtime import unavailable_reason

        if (why := unavailable_reason(Settings())) is not None:
            pytest.skip(f"vm runtime unavailable: {why}")
    srv = start_server(tmp_path, runtime_name, extra_env=KEEP_SANDBOXES)
    for key in ("E2B_API_URL", "E2B_SANDBOX_URL"):
        monkeypatch.setenv(key, srv.url)  # the same port after the restart
    monkeypatch.setenv("E2B_API_KEY", API_KEY)
    try:
        answer = _create(srv, bandwidth={"egressMbit": 12})
        assert answer.status_code == 201, answer.text
        sid = answer.json()["sandboxID"]
        ns_json = srv.state_dir / "sandboxes" / sid / "ns" / "ns.json"  # (its volume goes with the server)
        init = int(json.loads(ns_json.read_text())["pid"]) if runtime_name == "ns" else None
        stop_server(srv)
        if init is not None:
            assert kill_slirps_serving({init})  # its way out is gone until the adoption
        srv = start_server(tmp_path, runtime_name, extra_env=KEEP_SANDBOXES, port=int(srv.url.rsplit(":", 1)[1]))
        sbx = Sandbox.connect(sid)
        up = _rate(sbx, host, "up", 12)
        assert _within(up, 12), f"egress after a restart {up:.1f} Mbit/s, limit 12"
        sbx.kill()
    finally:
        stop_server(srv)
        discard_vm_state(srv.state_dir)

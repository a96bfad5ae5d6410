"""A uid range per team on ns (issue 37): two teams' sandboxes run as different host uids, a fork child
keeps its parent's range, a pause released to disk and resumed comes back in it, another team's
processes are refused, and a server with nothing to keep apart stays on ``ns_userns_uid`` itself.
Real servers through the E2B SDK and REST; needs root (ns runtime) and CRIU for fork and release."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from aenv.testing.server import KEEP_SANDBOXES, Server, start_server, stop_server
from aenv.uid_ranges import RANGE

pytestmark = pytest.mark.timeout(600)  # ns: its own servers (not the SDK pass on vm)

FIRST = 1_200_000_000
KA, KB, KADMIN = "team-a-key-" + "a" * 20, "team-b-key-" + "b" * 20, "admin-key-" + "c" * 20
ENV = {"AENV_TEAMS": json.dumps({"a": {"keys": [KA]}, "b": {"keys": [KB]}}), "AENV_ADMIN_KEYS": KADMIN,
       "AENV_POOL_SIZE": "1", "AENV_NS_RELEASE_PAUSED_AFTER": "0"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    if os.geteuid() != 0:
        pytest.skip("the ns runtime needs root")
    srv = start_server(tmp_path_factory.mktemp("team-uids"), "ns", ENV)
    try:
        yield srv
    finally:
        stop_server(srv)


def _sdk(srv: Server, key: str) -> dict[str, str]:
    return {"api_url": srv.url, "sandbox_url": srv.url, "api_key": key}


def _base(sbx: Sandbox) -> int:
    """The host uid that root in ``sbx`` is, from its own uid map (and the gid map says the same)."""
    out = sbx.commands.run("cat /proc/self/uid_map /proc/self/gid_map").stdout.split()
    assert len(out) == 6 and out[:3] == out[3:] and out[0] == "0" and out[2] == str(RANGE), out
    return int(out[1])


def _wait_log(srv: Server, line: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while line not in srv.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"no {line!r} in the server log:\n{srv.log_tail()}"
        time.sleep(0.2)


def test_teams_run_in_ranges_of_their_own(server: Server) -> None:
    a = Sandbox.create(**_sdk(server, KA))
    b = Sandbox.create(**_sdk(server, KB))
    try:
        base_a, base_b = _base(a), _base(b)
        assert len({base_a, base_b, FIRST}) == 3, (base_a, base_b)  # neither is the shared range
        for base in (base_a, base_b):
            assert (base - FIRST) % RANGE == 0 and base + RANGE <= 2**32 - 1
        # a second sandbox of a team (the pool refilled for its range meanwhile) is in the same range
        a2 = Sandbox.create(**_sdk(server, KA))
        try:
            assert _base(a2) == base_a
        finally:
            a2.kill()
        # a fork child keeps its parent's range
        forked = httpx.post(f"{server.url}/sandboxes/{a.sandbox_id}/fork", json={"count": 1},
                            headers={"X-API-KEY": KA}, trust_env=False, timeout=300)
        assert forked.status_code < 300, forked.text
        kid = Sandbox.connect(forked.json()[0]["sandbox"]["sandboxID"], **_sdk(server, KA))
        try:
            assert _base(kid) == base_a
        finally:
            kid.kill()

        # pause (released to disk at once: AENV_NS_RELEASE_PAUSED_AFTER=0) and resume: the same range
        b.commands.run("sleep 3600", background=True)
        b.pause()
        _wait_log(server, f"sandbox={b.sandbox_id} released to disk")
        back = Sandbox.connect(b.sandbox_id, timeout=600, **_sdk(server, KB))
        assert _base(back) == base_b
        _wait_log(server, f"sandbox={b.sandbox_id} restored from disk")
        procs = back.commands.run("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").stdout
        assert "sleep 3600" in procs  # its processes came back, in their range

        # a's processes never run in another team's range: a full snapshot of a's sandbox, started by
        # the admin (who sees every team's), is refused, saying why
        snap = httpx.post(f"{server.url}/sandboxes/{a.sandbox_id}/snapshots", json={"mode": "full"},
                          headers={"X-API-KEY": KA}, trust_env=False, timeout=300)
        assert snap.status_code == 201, snap.text
        made = httpx.post(f"{server.url}/sandboxes", json={"templateID": snap.json()["snapshotID"]},
                          headers={"X-API-KEY": KADMIN}, trust_env=False, timeout=300)
        assert made.status_code == 400 and "another team's uid range" in made.text, made.text
    finally:
        for sbx in (a, b):
            try:
                sbx.kill()
            except Exception:  # noqa: BLE001 - already gone
                pass


def test_a_server_with_one_team_keeps_the_shared_range(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the ns runtime needs root")
    srv = start_server(tmp_path, "ns", {"AENV_API_KEYS": KA, "AENV_POOL_SIZE": "0"})
    try:
        sbx = Sandbox.create(**_sdk(srv, KA))
        try:
            assert _base(sbx) == FIRST
        finally:
            sbx.kill()
    finally:
        stop_server(srv)


def test_a_restart_keeps_each_teams_range_and_its_adopted_sandboxes(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the ns runtime needs root")
    env = {**ENV, **KEEP_SANDBOXES}
    srv = start_server(tmp_path, "ns", env)
    try:
        kept = Sandbox.create(timeout=600, **_sdk(srv, KA))
        base_a = _base(kept)
        base_b = _base(Sandbox.create(**_sdk(srv, KB)))
    finally:
        stop_server(srv)
    # the same state dir: its store, its sandboxes adopted; this one ends them when it stops
    srv = start_server(tmp_path, "ns", ENV)
    try:
        again = Sandbox.connect(kept.sandbox_id, **_sdk(srv, KA))
        assert _base(again) == base_a  # adopted as it ran
        forked = httpx.post(f"{srv.url}/sandboxes/{kept.sandbox_id}/fork", json={"count": 1},
                            headers={"X-API-KEY": KA}, trust_env=False, timeout=300)
        assert forked.status_code < 300, forked.text
        assert _base(Sandbox.connect(forked.json()[0]["sandbox"]["sandboxID"], **_sdk(srv, KA))) == base_a
        assert _base(Sandbox.create(**_sdk(srv, KA))) == base_a  # new ones: the range the store kept
        assert _base(Sandbox.create(**_sdk(srv, KB))) == base_b
    finally:
        stop_server(srv)

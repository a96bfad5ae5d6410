"""``aenv fork``, ``aenv snapshot create|ls|rm`` and ``aenv rollback`` against the running server."""

from __future__ import annotations

import json
import os

from aenv.runtime.ns import criu
from tests.integration.conftest import Server
from tests.integration.test_cli import aenv

RUNTIME = os.environ.get("AENV_TEST_RUNTIME", "ns")


def test_cli_snapshot_fork_rollback(server: Server) -> None:
    r = aenv(server, "start", "base", "-d")
    assert r.returncode == 0, r.stderr.decode()
    sid = r.stdout.decode().strip()
    children: list[str] = []
    try:
        assert aenv(server, "exec", sid, "--", "sh", "-c", "echo v1 > /home/user/v").returncode == 0
        r = aenv(server, "snapshot", "create", sid, "--mode", "filesystem", "--name", "cli-snap")
        assert r.returncode == 0, r.stderr.decode()
        snap = r.stdout.decode().strip()
        # vm: memory always comes along (more than asked is said, never less)
        assert f"mode {'full' if RUNTIME == 'vm' else 'filesystem'}" in r.stderr.decode()
        if RUNTIME == "ns" and not criu.probe().usable:
            r = aenv(server, "snapshot", "create", sid)  # full by default
            assert r.returncode == 1
            assert r.stderr.decode().startswith("error: server answered 409") and b"filesystem" in r.stderr
            assert f"hint: take a files-only snapshot: aenv snapshot create {sid} --mode filesystem" \
                in r.stderr.decode()
        listed = json.loads(aenv(server, "snapshot", "ls", "--sandbox", sid, "-o", "json").stdout)
        assert [s["snapshotID"] for s in listed] == [snap] and listed[0]["names"] == ["cli-snap"]
        assert b"cli-snap" in aenv(server, "snapshot", "ls").stdout

        r = aenv(server, "fork", sid, "-n", "2")
        assert r.returncode == 0, r.stderr.decode()
        children = r.stdout.decode().split()
        assert len(children) == 2
        assert "2/2 children" in r.stderr.decode() and "mode " in r.stderr.decode()
        out = aenv(server, "exec", children[0], "--", "cat", "/home/user/v").stdout
        assert out == b"v1\n"

        assert aenv(server, "exec", sid, "--", "sh", "-c", "echo v2 > /home/user/v").returncode == 0
        r = aenv(server, "rollback", sid, snap)
        assert r.returncode == 0, r.stderr.decode()
        r = aenv(server, "exec", sid, "--", "cat", "/home/user/v")
        assert (r.returncode, r.stdout) == (0, b"v1\n"), r.stderr.decode()[-2000:]

        r = aenv(server, "snapshot", "rm", snap)  # the rolled-back sandbox runs on it
        assert r.returncode == 1 and b"409" in r.stderr
    finally:
        for c in children:
            aenv(server, "rm", c)
        aenv(server, "rm", sid)
    r = aenv(server, "snapshot", "rm", snap)
    assert r.returncode == 0, r.stderr.decode()
    r = aenv(server, "snapshot", "rm", snap)
    assert r.returncode == 3 and b"error:" in r.stderr

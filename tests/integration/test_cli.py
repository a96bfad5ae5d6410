"""The aenv CLI against the running server: start -d, exec (exit code and output), ls, files, lifecycle."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.integration.conftest import Server


def aenv(server: Server, *args: str, input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "AENV_SERVER": server.url, "NO_PROXY": "127.0.0.1,localhost"}
    return subprocess.run([sys.executable, "-m", "aenv.cli.main", *args], capture_output=True, env=env, input=input, timeout=120)


def test_cli_roundtrip(server: Server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    r = aenv(server, "start", "base", "-d")
    assert r.returncode == 0, r.stderr.decode()
    sid = r.stdout.decode().strip()
    assert sid.isalnum()
    r = aenv(server, "exec", sid, "--", "sh", "-c", "echo out; echo err >&2; exit 4")
    assert r.returncode == 4 and r.stdout.decode() == "out\n" and "err" in r.stderr.decode()
    listed = json.loads(aenv(server, "ls", "-o", "json").stdout)
    assert any(s["sandboxID"] == sid for s in listed)
    src = tmp_path / "up.txt"
    src.write_text("cli-upload")
    assert aenv(server, "upload", sid, str(src), "/home/user/up.txt").returncode == 0
    r = aenv(server, "download", sid, "/home/user/up.txt", "-")
    assert r.stdout == b"cli-upload"
    assert aenv(server, "timeout", sid, "120").returncode == 0
    assert aenv(server, "pause", sid).returncode == 0
    states = {s["sandboxID"]: s["state"] for s in json.loads(aenv(server, "ls", "-o", "json").stdout)}
    assert states[sid] == "paused"
    assert aenv(server, "resume", sid).returncode == 0
    assert aenv(server, "rm", sid).returncode == 0
    r = aenv(server, "rm", sid)
    assert r.returncode == 3 and b"error:" in r.stderr


def test_cli_unreachable_server_hint() -> None:
    env = {**os.environ, "AENV_SERVER": "http://127.0.0.1:1"}
    r = subprocess.run([sys.executable, "-m", "aenv.cli.main", "ls"], capture_output=True, env=env, timeout=60)
    assert r.returncode == 4
    assert b"error: cannot reach the aenv server" in r.stderr and b"hint:" in r.stderr

"""Zygote sockets of servers that died without closing them are swept; live servers' are kept."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from aenv.runtime.ns.zygote import socket_path_for, sweep_stale_sockets


def test_sweep_removes_only_sockets_of_gone_servers(tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer exists (reaped)
    dead = socket_path_for(tmp_path, gone.pid, 0xABC)
    alive = socket_path_for(tmp_path, os.getpid(), 0xDEF)
    odd = tmp_path / "aenv-zygote-notapid-1.sock"
    other = tmp_path / "unrelated.sock"
    for p in (dead, alive, odd, other):
        p.write_text("")
    assert dead.name == f"aenv-zygote-{gone.pid}-abc.sock"
    assert sweep_stale_sockets(tmp_path) == [dead]
    assert not dead.exists() and alive.exists() and odd.exists() and other.exists()

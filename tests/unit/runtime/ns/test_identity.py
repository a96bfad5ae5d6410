"""``runtime/ns/identity.py``: a sandbox's hostname is set in its own UTS namespace, nowhere else."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

from aenv.runtime.ns import identity


def test_refuses_what_is_not_a_hostname() -> None:
    for bad in ("", "a b", "-x", "x" * 64, "a/b"):
        with pytest.raises(ValueError):
            identity.set_hostname(os.getpid(), bad)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (unshare --uts)")
def test_names_the_namespace_of_the_pid_only() -> None:
    ours = socket.gethostname()
    proc = subprocess.Popen(["unshare", "--uts", "--", "sleep", "30"])
    try:
        for _ in range(200):  # until unshare has exec'd sleep in the new namespace
            if os.readlink(f"/proc/{proc.pid}/ns/uts") != os.readlink("/proc/self/ns/uts"):
                break
            subprocess.run(["sleep", "0.01"], check=True)
        identity.set_hostname(proc.pid, "sbx-test-1")
        out = subprocess.run(["nsenter", "--uts", "-t", str(proc.pid), "hostname"], capture_output=True,
                             text=True, check=True).stdout.strip()
        assert out == "sbx-test-1" and socket.gethostname() == ours
    finally:
        proc.kill()
        proc.wait()

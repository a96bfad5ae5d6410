"""``runtime/ns/identity.py``: a sandbox's hostname is set in its own UTS namespace, nowhere else."""

from __future__ import annotations

import os
import socket
import subprocess
import threading

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


def _in_new_uts() -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(["unshare", "--uts", "--", "sleep", "30"])
    for _ in range(200):
        if os.readlink(f"/proc/{proc.pid}/ns/uts") != os.readlink("/proc/self/ns/uts"):
            return proc
        subprocess.run(["sleep", "0.01"], check=True)
    raise AssertionError("unshare did not make a UTS namespace")


def _hostname_of(pid: int) -> str:
    return subprocess.run(["nsenter", "--uts", "-t", str(pid), "hostname"], capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (unshare --uts)")
def test_one_thread_names_many_namespaces_and_survives_a_failure() -> None:
    """The namer is one long-lived thread: it goes from namespace to namespace, a failed setns (a
    process that is gone) is the caller's error, and the next name still lands where it should."""
    ours = socket.gethostname()
    a, b = _in_new_uts(), _in_new_uts()
    gone = subprocess.Popen(["true"])
    gone.wait()
    try:
        identity.set_hostname(a.pid, "sbx-a")
        with pytest.raises(OSError):
            identity.set_hostname(gone.pid, "sbx-gone")
        identity.set_hostname(b.pid, "sbx-b")
        assert (_hostname_of(a.pid), _hostname_of(b.pid), socket.gethostname()) == ("sbx-a", "sbx-b", ours)
        assert "ns-uts" in {t.name for t in threading.enumerate()}
    finally:
        for p in (a, b):
            p.kill()
            p.wait()

"""The ns seccomp filter, loaded into a child process: what it refuses, with which errno, and that
ordinary work (fork, threads, exec, sockets) still runs under it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from aenv.agent import syscall_filter

CHILD = r"""
import ctypes, errno, json, os, socket, subprocess, sys, threading
from aenv.agent import syscall_filter
syscall_filter.install(no_new_privs=sys.argv[1] == "nnp")
libc = ctypes.CDLL(None, use_errno=True)
def sc(nr, *a):
    r = libc.syscall(nr, *a)
    return errno.errorcode.get(ctypes.get_errno(), "?") if r < 0 else "ok"
out = {
    "unshare": sc(272, 0x10000000), "mount": sc(165, None, b"/tmp", b"tmpfs", 0, None),
    "keyctl": sc(250, 0, 0), "bpf": sc(321, 0, 0, 0), "clone3": sc(435, 0, 0),
    "clone_newns": sc(56, 0x00020000 | 17, 0, 0, 0, 0), "perf": sc(298, 0, 0, -1, -1, 0),
    "open_by_handle_at": sc(304, 0, 0, 0), "personality_bad": sc(135, 0x0040000),
    "personality_query": sc(135, 0xffffffff), "vsock": sc(41, 40, 1, 0), "future": sc(470),
}
pid = os.fork()
if pid == 0:
    os._exit(7)
out["fork"] = os.waitpid(pid, 0)[1] >> 8
t = threading.Thread(target=lambda: None); t.start(); t.join()
with socket.socket() as s:
    out["inet"] = "ok"
out["status"] = subprocess.run(["grep", "-E", "^(Seccomp|NoNewPrivs):", "/proc/self/status"],
                               capture_output=True, text=True).stdout.split()
print(json.dumps(out))
"""


@pytest.mark.parametrize("mode", ["nnp", "plain"])
def test_filter_refuses_what_dockers_profile_refuses(mode: str) -> None:
    """``plain``: loaded without no_new_privs, as the launcher does (root with CAP_SYS_ADMIN here)."""
    if mode == "plain" and os.geteuid() != 0:
        pytest.skip("loading a filter without no_new_privs needs CAP_SYS_ADMIN (root)")
    proc = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=60,
                          check=True)
    out = json.loads(proc.stdout)
    for name in ("unshare", "mount", "keyctl", "bpf", "clone_newns", "perf", "open_by_handle_at",
                 "personality_bad"):
        assert out[name] == "EPERM", (name, out)
    assert out["clone3"] == "ENOSYS" and out["future"] == "ENOSYS"
    assert out["vsock"] == "EAFNOSUPPORT"
    assert out["personality_query"] == "ok" and out["inet"] == "ok" and out["fork"] == 7
    assert out["status"] == ["NoNewPrivs:", "1" if mode == "nnp" else "0", "Seccomp:", "2"]


def test_program_jumps_stay_inside_the_program() -> None:
    prog = syscall_filter.program()
    assert len(prog) < 4096
    for i, (code, jt, jf, _k) in enumerate(prog):
        if code & 0x07 == 0x05:  # BPF_JMP
            assert i + 1 + max(jt, jf) < len(prog)
    assert prog[-1] == (0x06, 0, 0, syscall_filter.SECCOMP_RET_ALLOW)


NESTED_CHILD = r"""
import ctypes, errno, json
from aenv.agent import syscall_filter
syscall_filter.install(no_new_privs=True, nested=True)
libc = ctypes.CDLL(None, use_errno=True)
def sc(nr, *a):
    r = libc.syscall(nr, *a)
    return errno.errorcode.get(ctypes.get_errno(), "?") if r < 0 else "ok"
out = {"unshare": sc(272, 0x10000000 | 0x00020000)}  # a user and a mount namespace of our own ...
out["mount"] = sc(165, b"none", b"/tmp", b"tmpfs", 0, None)  # ... so this tmpfs is only ours
out["keyctl"] = sc(250, 0, -3, 0)  # KEYCTL_GET_KEYRING_ID of the session keyring: not refused by the filter
out["bpf"] = sc(321, 0, 0, 0)
out["perf"] = sc(298, 0, 0, -1, -1, 0)
print(json.dumps(out))
"""


def test_nested_filter_lets_docker_mount_and_make_namespaces() -> None:
    """The nested variant (Docker inside, only ever in the sandbox's own user namespace) lets through
    what dockerd and runc need, and still refuses the rest (bpf, perf_event_open...)."""
    proc = subprocess.run([sys.executable, "-c", NESTED_CHILD], capture_output=True, text=True, timeout=60, check=True)
    out = json.loads(proc.stdout)
    if out["unshare"] != "ok":
        pytest.skip(f"this host does not let a process make a user namespace ({out['unshare']})")
    assert out["mount"] == "ok" and out["keyctl"] != "EPERM", out
    assert out["bpf"] == "EPERM" and out["perf"] == "EPERM", out
    assert all(nr in syscall_filter.DENIED for nr in syscall_filter.NESTED_ALLOWED)

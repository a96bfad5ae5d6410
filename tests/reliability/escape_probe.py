"""Escape attempts, run *inside* a sandbox by ``python3 escape_probe.py NAME [ARG]`` (stdlib only).

Each attempt prints one JSON line: ``{"ok": bool, "errno": "EPERM" | ..., "detail": ...}``; ``ok`` true
means the attempt worked (an escape, or the first step of one). test_escapes.py uploads this file.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import socket
import struct
import sys

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def _sys(nr: int, *args: object) -> dict[str, object]:
    ret = libc.syscall(nr, *args)
    err = ctypes.get_errno()
    return {"ok": ret >= 0, "errno": errno.errorcode.get(err, str(err)) if ret < 0 else "", "ret": ret}


def _os_error(fn) -> dict[str, object]:  # type: ignore[no-untyped-def]
    try:
        detail = fn()
    except OSError as exc:
        return {"ok": False, "errno": errno.errorcode.get(exc.errno or 0, str(exc.errno)), "detail": str(exc)}
    return {"ok": True, "errno": "", "detail": detail}


def read_file(path: str) -> dict[str, object]:
    def go() -> str:
        with open(path) as fh:
            return fh.read(200)
    return _os_error(go)


def write_file(path: str) -> dict[str, object]:
    def go() -> str:
        with open(path, "w") as fh:
            fh.write("|/tmp/x" if "core_pattern" in path else "h")
        return "written"
    return _os_error(go)


def open_by_handle(mount_path: str) -> dict[str, object]:
    """The 'shocker' attempt: a handle to inode 2 (an ext4/xfs root) opened through an fd on a host
    filesystem the sandbox can name (the read-only tools bind mount)."""
    fd = os.open(mount_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        handle = struct.pack("IiII", 8, 1, 2, 0)  # handle_bytes, FILEID_INO32_GEN, ino 2, generation 0
        buf = ctypes.create_string_buffer(handle)
        return _sys(304, fd, buf, os.O_RDONLY | os.O_DIRECTORY)
    finally:
        os.close(fd)


def mount_tmpfs() -> dict[str, object]:
    os.makedirs("/tmp/escape-mnt", exist_ok=True)
    return _sys(165, b"none", b"/tmp/escape-mnt", b"tmpfs", 0, None)


def unshare_user_mount() -> dict[str, object]:
    """unshare -U -m: a fresh user namespace would give full capabilities inside it."""
    return _sys(272, 0x10000000 | 0x00020000)


def unshare_mount() -> dict[str, object]:
    return _sys(272, 0x00020000)


def clone_newuser() -> dict[str, object]:
    SIGCHLD = 17
    res = _sys(56, 0x10000000 | SIGCHLD, None, None, None, 0)
    if res["ok"] and res["ret"] == 0:
        os._exit(0)
    if res["ok"]:
        os.waitpid(int(res["ret"]), 0)  # type: ignore[call-overload]
    return res


def load_module() -> dict[str, object]:
    fd = os.open("/dev/null", os.O_RDONLY)
    try:
        return _sys(313, fd, b"", 0)  # finit_module
    finally:
        os.close(fd)


def keyctl() -> dict[str, object]:
    return _sys(250, 0, ctypes.c_long(-3), 1)  # KEYCTL_GET_KEYRING_ID(session keyring, create)


def bpf() -> dict[str, object]:
    attr = ctypes.create_string_buffer(struct.pack("IIII", 2, 4, 4, 1) + bytes(112))  # array map
    return _sys(321, 0, attr, len(attr))


def perf_event_open() -> dict[str, object]:
    attr = ctypes.create_string_buffer(struct.pack("II", 1, 120) + bytes(112))  # SOFTWARE, size
    return _sys(298, attr, 0, -1, -1, 0)


def ptrace(pid: str) -> dict[str, object]:
    res = _sys(101, 16, int(pid), 0, 0)  # PTRACE_ATTACH
    res["visible"] = os.path.exists(f"/proc/{pid}")
    return res


def connect(target: str) -> dict[str, object]:
    host, port = target.rsplit(":", 1)

    def go() -> str:
        with socket.create_connection((host, int(port)), timeout=3) as s:
            return f"connected from {s.getsockname()}"
    try:
        return _os_error(go)
    except TimeoutError:
        return {"ok": False, "errno": "ETIMEDOUT"}


def gateway() -> dict[str, object]:
    """The default gateway and the name servers this sandbox can see (its route table, resolv.conf)."""
    gws = []
    with open("/proc/net/route") as fh:
        for line in fh.readlines()[1:]:
            fields = line.split()
            if fields[1] == "00000000" and fields[2] != "00000000":
                gws.append(socket.inet_ntoa(struct.pack("<I", int(fields[2], 16))))
    dns = []
    if os.path.exists("/etc/resolv.conf"):
        with open("/etc/resolv.conf") as fh:
            dns = [ln.split()[1] for ln in fh if ln.startswith("nameserver") and len(ln.split()) > 1]
    mine = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: only the source address is chosen
            mine.append(s.getsockname()[0])
        except OSError:
            pass
    return {"ok": True, "gateways": gws, "dns": dns, "self": mine}


PROBES = {
    "read": read_file, "write": write_file, "open_by_handle": open_by_handle, "mount": mount_tmpfs,
    "unshare_user_mount": unshare_user_mount, "unshare_mount": unshare_mount, "clone_newuser": clone_newuser,
    "load_module": load_module, "keyctl": keyctl, "bpf": bpf, "perf_event_open": perf_event_open,
    "ptrace": ptrace, "connect": connect, "gateway": gateway,
}

if __name__ == "__main__":
    name, *rest = sys.argv[1:]
    print(json.dumps(PROBES[name](*rest)))

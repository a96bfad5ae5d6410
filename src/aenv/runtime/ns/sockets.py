"""The sockets a sandbox's processes hold, asked of each socket itself (what a CRIU dump checks first).

A dump must find no socket of the host's network namespace in the tree (``checkpoint.host_sockets``)
and must know whether a TCP connection has a peer outside loopback (``criu.OUTSIDE_TCP_MARK``). The
/proc/<pid>/net/tcp{,6} tables answer both but cost ~5 ms each to read here: the kernel walks the
whole (host-wide) established hash for every read, and a quiesce polls. Each socket is asked
instead, through a copy of its descriptor (``pidfd_getfd``, Linux 5.6): its network namespace
(``SIOCGSKNS``), its TCP state and peer: a few system calls a socket. CRIU dumps only the sockets
the tree holds, so those are all a dump needs to know about.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import ipaddress
import os
import re
import select
import socket
from collections.abc import Iterator
from typing import TypeGuard

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_PIDFD_GETFD = 438  # the same number on every architecture (the unified syscall table)
_SIOCGSKNS = 0x894C  # linux/sockios.h: an fd of the socket's network namespace
_SOCKET = re.compile(r"socket:\[(\d+)\]")
_TCP_INFO_STATE = 0  # first byte of struct tcp_info
_TCP_CLOSE, _TCP_LISTEN = 7, 10  # include/net/tcp_states.h: the states without a peer


def held_sockets(pids: list[int]) -> list[tuple[int, int, int]]:
    """(pid, fd, inode) of every socket ``pids`` hold; a process or fd gone meanwhile is skipped."""
    found: list[tuple[int, int, int]] = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                m = _SOCKET.fullmatch(os.readlink(f"/proc/{pid}/fd/{fd}"))
                if m:
                    found.append((pid, int(fd), int(m.group(1))))
    return found


def tree_pids(init_pid: int) -> list[int]:
    """``init_pid`` and all its descendants (the tree CRIU dumps), from /proc's children lists."""
    pids, todo = [], [init_pid]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as fh:
                    todo.extend(int(c) for c in fh.read().split())
    return pids


@contextlib.contextmanager
def _copy_of(pid: int, fd: int) -> Iterator[socket.socket | None]:
    """A socket object on a copy of ``pid``'s ``fd`` (None: the process or the fd is gone)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        yield None
        return
    try:
        copy = _libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
        if copy < 0:
            err = ctypes.get_errno()
            if err in (errno.EBADF, errno.ESRCH):
                yield None
                return
            raise OSError(err, f"pidfd_getfd of pid {pid} fd {fd}: {os.strerror(err)}")
    finally:
        os.close(pidfd)
    try:
        sock = socket.socket(fileno=copy)
    except OSError:  # no longer a socket (the fd number was reused)
        os.close(copy)
        yield None
        return
    with sock:
        yield sock


def _listening_unix(sock: socket.socket | None) -> TypeGuard[socket.socket]:
    return sock is not None and sock.family == socket.AF_UNIX \
        and bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))


def unix_listeners(pids: list[int], under: str) -> list[tuple[int, int]]:
    """(pid, fd) of each listening unix socket ``pids`` hold that is bound to a path in the directory
    ``under`` (as the process named it)."""
    found: list[tuple[int, int]] = []
    for pid, fd, _ in held_sockets(pids):
        with _copy_of(pid, fd) as sock:
            if _listening_unix(sock):
                name = sock.getsockname()
                if isinstance(name, str) and os.path.dirname(name) == under:
                    found.append((pid, fd))
    return found


def has_queued(pid: int, fd: int) -> bool:
    """Whether connections wait for ``accept`` on the listening socket at ``pid``'s ``fd`` (False:
    gone, or no longer a listening socket): a listener is readable while its queue holds one."""
    with _copy_of(pid, fd) as sock:
        if not _listening_unix(sock):
            return False
        poll = select.poll()
        poll.register(sock, select.POLLIN)
        return bool(poll.poll(0))


def netns_inode(pid: int, fd: int) -> int | None:
    """The inode of the network namespace of the socket at ``pid``'s ``fd`` (None: gone)."""
    with _copy_of(pid, fd) as sock:
        if sock is None:
            return None
        ns = fcntl.ioctl(sock.fileno(), _SIOCGSKNS)
        try:
            return os.fstat(ns).st_ino
        finally:
            os.close(ns)


def _outside(host: str) -> bool:
    ip = ipaddress.ip_address(host.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return not (ip.is_loopback or ip.is_unspecified)


def tcp_peer_outside(pid: int, fd: int) -> bool:
    """Whether the socket at ``pid``'s ``fd`` is a TCP one with a peer that is not loopback. A
    connection still being made (its peer not readable yet) counts as outside: the mark it sets
    only adds a stand-in route during the restore."""
    with _copy_of(pid, fd) as sock:
        if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM \
                or sock.proto not in (0, socket.IPPROTO_TCP):
            return False
        state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[_TCP_INFO_STATE]
        if state in (_TCP_CLOSE, _TCP_LISTEN):
            return False
        try:
            peer = sock.getpeername()
        except OSError:
            return True
        return _outside(peer[0])


def has_outside_tcp(pids: list[int]) -> bool:
    """Whether any of ``pids`` holds a TCP socket with a peer outside loopback."""
    return any(tcp_peer_outside(pid, fd) for pid, fd, _ in held_sockets(pids))

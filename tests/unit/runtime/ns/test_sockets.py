"""``runtime/ns/sockets.py``: each held socket asked for its namespace, TCP state and peer."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aenv.runtime.ns import sockets


def test_outside_peers_are_what_is_neither_loopback_nor_unset() -> None:
    assert sockets._outside("203.0.113.9") and sockets._outside("10.0.2.100") and sockets._outside("2001:db8::1")
    assert not sockets._outside("127.0.0.1") and not sockets._outside("0.0.0.0")
    assert not sockets._outside("::1") and not sockets._outside("::ffff:127.0.0.1")
    assert sockets._outside("::ffff:203.0.113.9") and sockets._outside("fe80::1%lo")


def test_held_sockets_names_each_socket_fd_of_a_process() -> None:
    with socket.socket() as t, socket.socket(socket.AF_UNIX) as u:
        held = {(fd, inode) for pid, fd, inode in sockets.held_sockets([os.getpid()]) if pid == os.getpid()}
        assert {(x.fileno(), os.fstat(x.fileno()).st_ino) for x in (t, u)} <= held
    assert sockets.held_sockets([2 ** 22 + 1]) == []  # no such process: nothing, no error


def test_tree_pids_are_a_process_and_its_descendants() -> None:
    tree = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"])
    try:
        for _ in range(200):
            pids = sockets.tree_pids(tree.pid)
            if len(pids) == 3:
                break
            time.sleep(0.01)
        assert pids[0] == tree.pid and len(pids) == 3 and os.getpid() not in pids
    finally:
        tree.kill()
        tree.wait()


def test_a_socket_names_its_network_namespace() -> None:
    with socket.socket() as s:
        assert sockets.netns_inode(os.getpid(), s.fileno()) == os.stat("/proc/self/ns/net").st_ino
    fd = os.open("/dev/null", os.O_RDONLY)
    try:
        assert sockets.netns_inode(os.getpid(), 10_000) is None  # no such fd
        assert sockets.netns_inode(os.getpid(), fd) is None  # not a socket
    finally:
        os.close(fd)


def test_tcp_peers_outside_loopback_are_found() -> None:
    me = os.getpid()
    with socket.create_server(("127.0.0.1", 0)) as listener, \
            socket.create_connection(listener.getsockname()) as client, socket.socket(socket.AF_UNIX) as u:
        served, _ = listener.accept()
        with served:
            assert not any(sockets.tcp_peer_outside(me, x.fileno()) for x in (listener, client, served, u))
    # The whole-process answer, of a process that holds only such sockets: this one (a long pytest
    # session) may hold anything earlier tests left in their connection pools.
    code = ("import socket, time; l = socket.create_server(('127.0.0.1', 0)); "
            "c = socket.create_connection(l.getsockname()); s, _ = l.accept(); u = socket.socket(socket.AF_UNIX); "
            "print('ready', flush=True); time.sleep(30)")
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            assert len(sockets.held_sockets([proc.pid])) == 4
            assert not sockets.has_outside_tcp([proc.pid])
        finally:
            proc.kill()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: unshare --net")
def test_a_connection_being_made_to_outside_counts() -> None:
    """A SYN_SENT socket (no peer readable yet), in a namespace of its own with a route out through
    loopback (nothing answers there), is a TCP connection with a peer outside."""
    code = ("import socket, time; s = socket.socket(); s.setblocking(False); s.connect_ex(('203.0.113.9', 80)); "
            "print(s.fileno(), flush=True); time.sleep(30)")
    argv = ["unshare", "--net", "sh", "-c", f"ip link set lo up && ip route add default dev lo && exec {sys.executable} -c \"{code}\""]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            fd = int(proc.stdout.readline())
            assert sockets.tcp_peer_outside(proc.pid, fd) and sockets.has_outside_tcp(sockets.tree_pids(proc.pid))
        finally:
            proc.kill()


def test_queued_connections_on_listeners_in_a_directory(tmp_path: Path) -> None:
    """A connection closed before it was accepted stays queued (what CRIU calls a closed in-flight
    socket); the listener reads as having one until it is accepted."""
    me = os.getpid()
    here, elsewhere = str(tmp_path / "run"), str(tmp_path / "other")
    os.mkdir(here)
    os.mkdir(elsewhere)
    with socket.socket(socket.AF_UNIX) as ours, socket.socket(socket.AF_UNIX) as theirs, \
            socket.socket(socket.AF_UNIX) as unbound:
        ours.bind(f"{here}/envd.sock")
        theirs.bind(f"{elsewhere}/x.sock")
        for s in (ours, theirs):
            s.listen()
        found = sockets.unix_listeners([me], here)
        assert found == [(me, ours.fileno())]
        assert not sockets.has_queued(me, ours.fileno())
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(f"{here}/envd.sock")
        assert sockets.has_queued(me, ours.fileno())  # its client has gone; it waits all the same
        ours.accept()[0].close()
        assert not sockets.has_queued(me, ours.fileno())
        assert not sockets.has_queued(me, unbound.fileno()) and not sockets.has_queued(me, 10_000)

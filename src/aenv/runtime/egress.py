"""Enforcing a sandbox's egress policy: its filter, and the egress proxy that checks domain rules.

Shared by both runtimes; one :data:`ENFORCER` per server. A runtime hands it every network
namespace it sets up (``install``: ns at launch, vm in ``netjail.connect`` before slirp4netns gives it
a way out) and it renders that namespace's filter with the policy registered for the sandbox, so a
sandbox (a fork child, a vm restored into a new QEMU) never runs a moment without its policy; ``apply``
replaces the filter of a running one (``PUT /sandboxes/{id}/network``), atomically, and cuts
connections the new rules deny (the filter has no ``ESTABLISHED`` exception).

Domain rules need the host name of each connection, which only the connection itself carries. With a
domain in ``allowOut`` and something denied, TCP to a denied address is redirected (iptables
``REDIRECT`` in the namespace's ``nat`` table) to a listener the server owns *inside that namespace*
(a socket made there with ``setns``, accepted on the server's event loop). The proxy reads the first
bytes, takes the TLS SNI or the HTTP ``Host``, and lets the connection through only for an allowed
domain, to an address that domain resolves to (the sandbox's claim of a name cannot send it to any
other address: a name from the sandbox's ``/etc/hosts`` is resolved again), never to the host or a
private range; anything else is closed. It connects from the host's side as slirp4netns does.

E2B's header rules (``network.rules``) send TCP to ports 80 and 443 (and those a rule names) to the
same proxy, whatever the address: a connection whose name matches a rule is served by
``egress_mitm.py`` (TLS terminated with the sandbox's own CA, headers set on every request), to an
address the name resolves to; any other goes on to where it was going, if the policy allows it. A rule
naming one of this server's own sandbox hosts goes to the server's public listener instead
(``egress_own.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import ipaddress
import logging
import os
import socket
import ssl
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from aenv.envd.relay import pipe
from aenv.runtime import egress_rules, network
from aenv.runtime.egress_ca import EgressCa, new_ca, upstream_context
from aenv.runtime.egress_mitm import intercept
from aenv.runtime.egress_own import OwnHosts
from aenv.runtime.netpolicy import EgressPolicy
from aenv.runtime.nsthread import run_in_namespace
from aenv.runtime.sniff import MAX_PEEK, NeedMore, a_answers, a_query, host_name

log = logging.getLogger("aenv.egress")

_SO_ORIGINAL_DST = 80
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_PEEK_TIMEOUT = 10.0
_RESOLVE_TTL = 30.0
_BLOCKED = tuple(ipaddress.IPv4Network(c) for c in network.BLOCKED_RANGES)


def _netns_inode(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def _loopback_ready() -> None:
    """In the calling thread's network namespace: ``lo`` up (a vm's QEMU jail leaves it down) and
    ``route_localnet`` on (a connection redirected to 127.0.0.1 keeps the source address of the
    sandbox's interface, which loopback would otherwise drop as a martian). An ioctl and a sysctl
    write instead of ``nsenter sh -c 'ip link ...'``: three execs, ~12 ms of a create."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack_from("16sH", fcntl.ioctl(s, _SIOCGIFFLAGS, ifreq))[1]
        if not flags & _IFF_UP:
            fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))
    # /proc/sys/net is the namespace of the thread that opens it (unlike /proc/net: the process's)
    with open("/proc/sys/net/ipv4/conf/all/route_localnet", "w") as f:
        f.write("1")


def listen_in_netns(pid: int) -> socket.socket:
    """A listening TCP socket on 127.0.0.1 (port chosen by the kernel) in ``pid``'s network namespace,
    its loopback made ready for redirected connections. Made on a thread of its own that enters the
    namespace and ends: no other thread ever changes."""

    def listen(_libc: ctypes.CDLL) -> socket.socket:
        _loopback_ready()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("127.0.0.1", 0))
            sock.listen(256)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    return run_in_namespace(pid, "net", listen, thread_name=f"netns-{pid}")


def _listener(pid: int) -> socket.socket:
    try:
        return listen_in_netns(pid)
    except OSError as exc:
        raise network.NetworkError(f"no egress listener in the network namespace of {pid}: {exc}") from exc


def _write(tool: str, pid: int, host_addrs: list[str], policy: EgressPolicy,
           restorer: network.Restorer | None) -> socket.socket | None:
    """Blocking: the listener's socket if ``policy`` needs the proxy, then the filter that redirects to it."""
    sock = _listener(pid) if policy.needs_proxy else None
    try:
        network.write_firewall(tool, pid, host_addrs, policy, sock.getsockname()[1] if sock else None, restorer)
    except BaseException:
        if sock is not None:
            sock.close()
        raise
    return sock


def original_dst(sock: socket.socket) -> tuple[str, int]:
    raw = sock.getsockopt(socket.SOL_IP, _SO_ORIGINAL_DST, 16)
    port = struct.unpack_from("!H", raw, 2)[0]
    return socket.inet_ntoa(raw[4:8]), port


@dataclass
class _Listener:
    inode: int
    server: asyncio.Server
    port: int
    conns: set[asyncio.StreamWriter] = field(default_factory=set)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def close(self) -> None:
        """The server and every connection end; their handlers are cancelled, not left waiting on an
        upstream (a kept-alive server may not close for seconds)."""
        self.server.close()
        for w in list(self.conns):
            w.close()
        for t in list(self.tasks):
            t.cancel()


# Every connection's handler, until it ends. asyncio's streams hold a reader only weakly: a handler
# waiting on an upstream after the sandbox's side half-closed (its transport out of the selector) is
# otherwise reachable from nothing, and the garbage collector would destroy it pending.
_HANDLERS: set[asyncio.Task[None]] = set()


class CaStore(Protocol):
    """Where the sandboxes' egress CAs are kept (``store/secrets.CaLog``)."""

    def get(self, sandbox_id: str) -> tuple[bytes, bytes] | None: ...
    def put(self, sandbox_id: str, cert_pem: bytes, key_pem: bytes, at: float) -> None: ...
    def delete(self, sandbox_id: str) -> None: ...


class Enforcer:
    """Policies by sandbox, the filters they became, and the egress proxy's listeners."""

    def __init__(self) -> None:
        self.policies: dict[str, EgressPolicy] = {}
        self._listeners: dict[str, _Listener] = {}
        self._host_addrs: set[str] = set()
        self._installed: dict[str, int] = {}  # key -> the network namespace (inode) its filter is in
        self._resolved: dict[str, tuple[float, list[str]]] = {}
        # header rules: set by the server at start (``configure_rules``)
        self._secret_value: Callable[[str], str | None] = lambda _id: None
        self._ca_store: CaStore | None = None
        self._cas: dict[str, EgressCa] = {}
        self._extra_ca: str | None = None
        self._upstream_ssl: ssl.SSLContext | None = None

    def configure_rules(self, secret_value: Callable[[str], str | None], ca_store: CaStore | None,
                        extra_ca: str | None) -> None:
        """What header rules need: a secret's current value by ID, where CAs are kept, and the extra
        CA bundle upstream servers are verified with (besides the system's)."""
        self._secret_value, self._ca_store, self._extra_ca = secret_value, ca_store, extra_ca
        self._upstream_ssl = None

    def ca(self, key: str) -> EgressCa:
        """``key``'s egress CA: loaded, or made (and kept) the first time."""
        ca = self._cas.get(key)
        if ca is None:
            kept = self._ca_store.get(key) if self._ca_store is not None else None
            if kept is None:
                kept = new_ca(key)
                if self._ca_store is not None:
                    self._ca_store.put(key, *kept, time.time())
                    kept = self._ca_store.get(key) or kept  # a concurrent maker's, if it won
            ca = self._cas[key] = EgressCa(*kept)
        return ca

    def ca_pem(self, key: str) -> bytes | None:
        """The certificate ``key``'s sandbox must trust: its CA's, where its policy has header rules."""
        policy = self.policies.get(key)
        return self.ca(key).cert_pem if policy is not None and policy.rules else None

    def _upstream(self) -> ssl.SSLContext:
        if self._upstream_ssl is None:
            self._upstream_ssl = upstream_context(self._extra_ca)
        return self._upstream_ssl

    def register(self, key: str, policy: EgressPolicy | None) -> None:
        if policy is None or policy.empty:
            self.policies.pop(key, None)
        else:
            self.policies[key] = policy

    def has(self, key: str) -> bool:
        return key in self.policies or key in self._listeners

    def forget(self, key: str) -> None:
        """The sandbox is gone: drop its policy and end its proxy and connections."""
        self.policies.pop(key, None)
        self._installed.pop(key, None)
        self._cas.pop(key, None)
        if self._ca_store is not None:
            with contextlib.suppress(Exception):  # a CA row left behind is only a row
                self._ca_store.delete(key)
        lst = self._listeners.pop(key, None)
        if lst is not None:
            lst.close()

    async def ensure(self, key: str, pid: int, host_addrs: list[str], jail: bool = False) -> None:
        """``install`` unless ``pid``'s namespace already has ``key``'s filter."""
        try:
            if self._installed.get(key) == _netns_inode(pid):
                return
        except OSError:
            return  # gone: nothing to filter
        await self.install(key, pid, host_addrs, jail=jail)

    def close(self) -> None:
        """Server stop: the listeners end (a sandbox's redirected connections then fail, closed)."""
        for key in list(self._listeners):
            self._listeners.pop(key).close()

    async def install(self, key: str, pid: int, host_addrs: list[str],
                      restorer: network.Restorer | None = None, jail: bool = False) -> None:
        """Write the filter of ``pid``'s namespace with ``key``'s policy (the base filter without one),
        through ``restorer`` if one was started there. ``jail``: a vm's QEMU namespace, whose loopback
        is made ready first where host services are exposed (its guest's 10.0.2.2 is that loopback,
        which the filter forwards to slirp4netns's gateway: ``netpolicy.render``)."""
        policy = self.policies.get(key)
        if jail and network.private_allowlist().host_ports:
            await asyncio.to_thread(run_in_namespace, pid, "net", lambda _libc: _loopback_ready(),
                                    thread_name=f"netns-{pid}")
        self._host_addrs.update(host_addrs)
        port = None
        if policy is not None and policy.needs_proxy:
            port = await self._listen(key, pid)
        else:
            lst = self._listeners.pop(key, None)
            if lst is not None:
                lst.close()
        await network.install_firewall(pid, host_addrs, policy, port, restorer, jail)
        if key:
            self._installed[key] = _netns_inode(pid)

    def start_install(self, key: str, pid: int, host_addrs: list[str],
                      restorer: network.Restorer | None = None) -> Awaitable[None]:
        """``install`` of a policy into a namespace that has none of ``key``'s yet, its blocking part
        (the listener's socket, the restore) started on a worker thread now, not when the event loop
        next gets to a task (a pool refill may be ahead of it): a hand-out's, whose streams wait for it
        (``runtime/ns/handout.py``). The rules redirect to the socket before its server is attached:
        connections wait in its backlog."""
        policy, tool = self.policies.get(key), network.known_tool()
        try:
            inode = _netns_inode(pid)
        except OSError:
            inode = None
        if policy is None or tool is None or inode is None or key in self._listeners:
            return self.install(key, pid, host_addrs, restorer)
        self._host_addrs.update(host_addrs)
        written = asyncio.get_running_loop().run_in_executor(None, _write, tool, pid, host_addrs, policy, restorer)
        return self._written(key, inode, written)

    async def _written(self, key: str, inode: int, written: asyncio.Future[socket.socket | None]) -> None:
        sock = await written
        if sock is not None:
            await self._serve_on(key, inode, sock)
        self._installed[key] = inode

    async def _listen(self, key: str, pid: int) -> int:
        inode = _netns_inode(pid)
        lst = self._listeners.get(key)
        if lst is not None and lst.inode == inode:
            return lst.port
        if lst is not None:
            lst.close()
        return await self._serve_on(key, inode, await asyncio.to_thread(_listener, pid))

    async def _serve_on(self, key: str, inode: int, sock: socket.socket) -> int:
        """The proxy's server on ``sock`` (listening in the namespace ``inode``), as ``key``'s listener."""
        conns: set[asyncio.StreamWriter] = set()
        tasks: set[asyncio.Task[None]] = set()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            conns.add(writer)
            tasks.add(task)
            _HANDLERS.add(task)
            try:
                await self._serve(key, reader, writer)
            except asyncio.CancelledError:
                pass  # its listener closed; ended here (3.11's streams call a cancelled handler's exception())
            finally:
                conns.discard(writer)
                tasks.discard(task)
                _HANDLERS.discard(task)
                writer.close()

        try:
            server = await asyncio.start_server(handle, sock=sock)
        except BaseException:
            sock.close()
            raise
        lst = _Listener(inode, server, sock.getsockname()[1], conns, tasks)
        self._listeners[key] = lst
        return lst.port

    # ---- the proxy --------------------------------------------------------------------------------
    async def _serve(self, key: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            dst, port = original_dst(writer.get_extra_info("socket"))
        except OSError:
            return
        data = b""
        name: str | None = None
        try:
            async with asyncio.timeout(_PEEK_TIMEOUT):
                while True:
                    chunk = await reader.read(MAX_PEEK - len(data))
                    if not chunk:
                        return
                    data += chunk
                    try:
                        name = host_name(data)
                        break
                    except NeedMore:
                        if len(data) >= MAX_PEEK:
                            break
        except (TimeoutError, ConnectionError):
            return
        policy = self.policies.get(key)
        rules = egress_rules.matching(policy.rules, name, port) if policy is not None and name else []
        own = network.own_hosts()
        if policy is not None and rules and own is not None and name and own.names(name):
            await self._to_own(key, reader, writer, data, own, name, port, rules, policy)
            return
        if policy is not None and (rules or (name and policy.allows_domain(name))):
            assert name is not None
            addrs = await self._resolve(name)
            target = dst if dst in addrs else next(iter(addrs), None)
            if target is None or self._unreachable(target):
                log.info("sandbox=%s egress denied: %s resolves to %s", key, name, addrs or "nothing")
                return
            if rules and not (policy.allows_domain(name) or policy.ip_allowed(target)):
                log.info("sandbox=%s egress denied: %s:%d (%s)", key, dst, port, name)
                return
        elif policy is not None and policy.ip_allowed(dst) and not self._unreachable(dst):
            target = dst  # a rule's port, not a rule's name: on to where it was going
        else:
            log.info("sandbox=%s egress denied: %s:%d (%s)", key, dst, port, name or "no host name")
            return
        if rules:
            assert name is not None
            tls = data[:1] == b"\x16"
            ca = await asyncio.to_thread(self.ca, key) if tls else None
            await intercept(key, reader, writer, data, host=name, target=target, port=port, rules=rules, tls=tls,
                            ca=ca, upstream_ssl=self._upstream() if tls else None, lookup=self._secret_value)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(target, port)
        except OSError as exc:
            log.info("sandbox=%s egress to %s (%s:%d) failed: %r", key, name, target, port, exc)
            return
        try:
            up_writer.write(data)
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        finally:
            up_writer.close()

    async def _to_own(self, key: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes,
                      own: OwnHosts, name: str, port: int, rules: list[egress_rules.HeaderRule],
                      policy: EgressPolicy) -> None:
        """A rule's name is one of this server's sandbox hosts: to the server's own public listener, as
        an internet client (``egress_own.py``). It counts as the internet: refused where the policy
        denies all of it and allowOut does not name the host."""
        if not policy.allows_domain(name) and any(n.prefixlen == 0 for n in policy.deny_nets):
            log.info("sandbox=%s egress denied: %s (the internet is denied)", key, name)
            return
        tls = data[:1] == b"\x16"
        ca = await asyncio.to_thread(self.ca, key) if tls else None
        await intercept(key, reader, writer, data, host=name, target=own.addr, port=own.port, rules=rules, tls=tls,
                        ca=ca, upstream_ssl=self._upstream() if own.tls else None, lookup=self._secret_value,
                        upstream_tls=own.tls, pinned=port)

    def _unreachable(self, addr: str) -> bool:
        ip = ipaddress.IPv4Address(addr)
        return addr in self._host_addrs or any(ip in n for n in _BLOCKED)

    async def _resolve(self, name: str) -> list[str]:
        """The A records of ``name`` from the sandboxes' resolver (cached briefly)."""
        hit = self._resolved.get(name)
        if hit is not None and time.monotonic() - hit[0] < _RESOLVE_TTL:
            return hit[1]
        server = network.resolver()
        addrs: list[str] = []
        with contextlib.suppress(OSError, TimeoutError):
            if server == network.SLIRP_DNS:  # slirp's resolver asks the host's: so do we
                infos = await asyncio.get_running_loop().getaddrinfo(name, None, family=socket.AF_INET,
                                                                     type=socket.SOCK_STREAM)
                addrs = sorted({str(i[4][0]) for i in infos})
            else:
                addrs = await _query(server, name)
        self._resolved[name] = (time.monotonic(), addrs)
        return addrs


async def _query(server: str, name: str, timeout: float = 3.0) -> list[str]:
    loop = asyncio.get_running_loop()
    qid, query = a_query(name)
    answer: asyncio.Future[list[str]] = loop.create_future()

    class _Reply(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr: tuple[str | bytes, int]) -> None:
            if not answer.done():
                answer.set_result(a_answers(qid, data))

        def error_received(self, exc: Exception) -> None:
            if not answer.done():
                answer.set_result([])

    transport, _ = await loop.create_datagram_endpoint(_Reply, remote_addr=(server, 53))
    try:
        transport.sendto(query)
        async with asyncio.timeout(timeout):
            return await answer
    finally:
        transport.close()


ENFORCER = Enforcer()

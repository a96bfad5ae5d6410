"""Loopback relays (``/init``'s ``aenvLoopbackRelay``): a guest's connections to ``127.0.0.1:PORT`` go
out to the host side.

Why: a header rule may name another sandbox of this server by its public URL
(``<port>-<id>.<sandbox domain>``, ``runtime/egress_own.py``). Under a ``*.localhost`` domain curl
resolves such a name to loopback by itself (RFC 6761: no resolver, no ``/etc/hosts`` is asked), so in a
vm guest the connection ends on the guest's own loopback. An ns sandbox's filter sends loopback on those
ports to the egress proxy; a guest kernel has no netfilter, so envd does it in user space: it listens on
``127.0.0.1:PORT`` and pipes each connection to ``to:PORT`` (the vm's slirp gateway, which QEMU's jail
filter sends to the egress proxy). It opens no new way out: the guest reaches ``to:PORT`` directly as
well. The host sends the whole set on every ``/init`` (create, restore, a rule update); an empty set
closes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from typing import Any

log = logging.getLogger("aenv.envd.relay")

MAX_PORTS = 16
_CHUNK = 64 * 1024


def parse(value: object) -> tuple[str, tuple[int, ...]]:
    """``{"to": "<IPv4>", "ports": [PORT, ...]}`` validated: the address and the ports. Raises ValueError."""
    if not isinstance(value, dict):
        raise ValueError("aenvLoopbackRelay must be an object")  # noqa: TRY004
    to, ports = value.get("to"), value.get("ports")
    try:
        addr = ipaddress.IPv4Address(to) if isinstance(to, str) else None
    except ValueError:
        addr = None
    if addr is None or addr.is_loopback or addr.is_unspecified:
        raise ValueError("aenvLoopbackRelay.to must be an IPv4 address off this machine's loopback")
    if (not isinstance(ports, list) or len(ports) > MAX_PORTS
            or not all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in ports)):
        raise ValueError(f"aenvLoopbackRelay.ports must be a list of at most {MAX_PORTS} TCP ports")
    return str(addr), tuple(sorted(set(ports)))


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy one direction of a relayed connection until EOF, then half-close (the host's egress proxy
    relays the same way: ``runtime/egress.py``)."""
    try:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()


class Relays:
    """The loopback relays this guest runs, by port."""

    def __init__(self) -> None:
        self._servers: dict[int, tuple[str, asyncio.Server]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def ports(self) -> tuple[int, ...]:
        return tuple(sorted(self._servers))

    async def set(self, to: str, ports: tuple[int, ...]) -> str:
        """Relay exactly ``ports`` to ``to``; what it did, for the ``/init`` answer (``relay=<ports>``, or
        ``relay=failed`` when a port could not be taken: something in the guest listens on it)."""
        for port, (dest, server) in list(self._servers.items()):
            if port not in ports or dest != to:
                server.close()
                del self._servers[port]
        failed = False
        for port in ports:
            if port in self._servers:
                continue
            try:
                server = await asyncio.start_server(self._handler(to, port), "127.0.0.1", port, reuse_address=True)
            except OSError as exc:
                log.warning("relay: cannot listen on 127.0.0.1:%d: %s", port, exc)
                failed = True
                continue
            self._servers[port] = (to, server)
        return "failed" if failed else "+".join(map(str, self.ports)) or "none"

    def _handler(self, to: str, port: int) -> Any:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            if task is not None:
                self._tasks.add(task)
            try:
                up_reader, up_writer = await asyncio.open_connection(to, port)
            except OSError as exc:
                log.info("relay: %s:%d unreachable: %s", to, port, exc)
                writer.close()
                return
            try:
                await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
            finally:
                for w in (writer, up_writer):
                    w.close()
                    with contextlib.suppress(ConnectionError, OSError):
                        await w.wait_closed()
                if task is not None:
                    self._tasks.discard(task)

        return handle

    async def aclose(self) -> None:
        """Every relay and its connections end."""
        for _, server in self._servers.values():
            server.close()
        self._servers.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

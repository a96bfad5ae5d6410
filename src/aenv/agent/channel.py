"""The agent's end of the host↔sandbox channel.

Two transports carry the same mux protocol:

* ``unix-listen:PATH`` (ns): a listening unix socket in the sandbox's run dir (``/.aenv-run``), which
  the host sees through a bind mount. Every host connection is its own mux session; the host
  reconnects after a server restart and simply gets a new one.
* ``serial:PATH`` (vm): a virtio-serial character device. It is always "open"; while no host is
  attached ``read`` returns 0, so we sleep briefly and retry instead of treating it as EOF. A host
  that (re)attaches sends HELLO, which resets the streams of the session; which session the bytes
  after a host left belong to is agent.serial_readers' call.

Every stream the host opens is bridged to ``127.0.0.1:<port>`` inside the sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable

from aenv.agent.serial_readers import SerialReaders
from aenv.mux import MuxSession

log = logging.getLogger("aenv.agent")

Connector = Callable[[int], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]

ENVD_PORT = 49983
# envd's own unix socket, next to the mux socket in the run dir (ns only): the host connects there
# directly for envd traffic; the mux carries everything else.
ENVD_SOCKET = "envd.sock"
_ENVD_WAIT = 60.0  # envd may still be starting (slow under a burst of starts) or restarting


def make_local_connector(
    wait_ports: frozenset[int] = frozenset({ENVD_PORT}), any_port_until: float = 0.0
) -> Connector:
    """accept(port) for the mux: connect to 127.0.0.1:port. For ports in ``wait_ports`` (envd) a
    refused connection is retried for a while, so the host needs no readiness polling of its own.

    ``any_port_until`` (a ``time.monotonic()`` deadline) extends that to every port while a template's
    start command is still coming up: the SDK calls a service such as the code interpreter (port 49999)
    right after create, and "port not open" then would be a spurious failure."""

    async def accept(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        now = time.monotonic()
        deadline = max(now + (_ENVD_WAIT if port in wait_ports else 0.0), any_port_until)
        delay = 0.001
        while True:
            try:
                return await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
            except (ConnectionRefusedError, ConnectionResetError):
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.02)

    return accept


async def serve_unix(path: str, accept: Connector, ready: Callable[[], None] | None = None,
                     on_session: Callable[[], object] | None = None) -> None:
    """Listen on ``path`` forever; one mux session per host connection. ``on_session``: called as each
    begins (the first after a restore is how a restored agent learns it was restored)."""

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if on_session is not None:
            on_session()
        session = MuxSession(reader, writer, accept=accept, name="agent")
        try:
            await session.run()
        finally:
            await session.aclose()

    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    server = await asyncio.start_unix_server(on_conn, path, limit=1 << 20)
    os.chmod(path, 0o600)
    if ready is not None:
        ready()
    async with server:
        await server.serve_forever()


class _SerialWriter:
    """The StreamWriter subset MuxSession uses, over a blocking fd written from a worker thread."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buf = bytearray()
        self._closed = False

    def write(self, data: bytes) -> None:
        self._buf += data

    async def drain(self) -> None:
        data, self._buf = bytes(self._buf), bytearray()
        if data:
            await asyncio.to_thread(self._write_all, data)

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]

    def close(self) -> None:
        self._closed = True

    def is_closing(self) -> bool:
        return self._closed

    def can_write_eof(self) -> bool:
        return False

    async def wait_closed(self) -> None:
        return None


async def serve_serial(path: str, accept: Connector, ready: Callable[[], None] | None = None) -> None:
    """Run mux sessions over a virtio-serial port forever, surviving host disconnects.

    A host that goes away may leave half a frame behind (it was paused or killed mid-write), which
    would swallow the next host's HELLO; when the port reports the host gone (``read`` returns 0),
    SerialReaders decides whether the session goes on or the next bytes start a fresh one."""
    loop = asyncio.get_running_loop()
    fd = os.open(path, os.O_RDWR | os.O_NOCTTY)
    readers = SerialReaders()
    stop = threading.Event()

    def pump() -> None:
        # read() == 0 means "no host attached" on virtio-serial, not end of file.
        attached = False
        while not stop.is_set():
            try:
                data = os.read(fd, 65536)
            except InterruptedError:
                continue
            except OSError as exc:
                log.warning("serial read: %s", exc)
                time.sleep(0.05)
                continue
            if not data:
                if attached:
                    attached = False
                    loop.call_soon_threadsafe(readers.host_gone)
                time.sleep(0.002)
                continue
            attached = True
            loop.call_soon_threadsafe(readers.feed, data)  # in order: after any host_gone

    thread = threading.Thread(target=pump, name="serial-reader", daemon=True)
    thread.start()
    if ready is not None:
        ready()
    try:
        await run_sessions(readers, lambda: _SerialWriter(fd), accept)  # type: ignore[arg-type,return-value]
    finally:
        stop.set()
        os.close(fd)


async def run_sessions(
    readers: SerialReaders,
    make_writer: Callable[[], asyncio.StreamWriter],
    accept: Connector,
    on_hello: Callable[[bytes], None] | None = None,
) -> None:
    """One mux session after another on ``readers.current``, forever (``serve_serial``'s loop).
    ``on_hello`` defaults to :func:`apply_host_facts`."""
    while True:
        reader = readers.current
        session = MuxSession(
            reader, make_writer(), accept=accept, name="agent-serial", on_hello=on_hello or apply_host_facts
        )
        try:
            await session.run()
        finally:
            await session.aclose()
        if readers.current is reader:  # ended by itself (a protocol error): the next bytes start afresh
            readers.renew()
            log.warning("serial session ended; starting a new one")
        await asyncio.sleep(0.01)


def apply_host_facts(extra: bytes) -> None:
    """The vm host's HELLO extension, ``{"hostTime": unix seconds, "seed": base64, "volumes": ...}``:
    set the wall clock, reseed the kernel CRNG and mount the sandbox's volumes. A VM's clock stands
    still while it is stopped or saved, a restored or forked copy shares its snapshot's CRNG state
    and holds 9p mounts of a QEMU that is gone; every new host session follows a restore, fork or
    resume, and this runs before the session's first stream is opened."""
    import base64
    import json

    from aenv.envd.identity import MAX_SEED_BYTES, reseed_rng, set_wall_clock

    facts = json.loads(extra)
    host_time, seed = facts.get("hostTime"), base64.b64decode(facts.get("seed") or "")
    if isinstance(host_time, (int, float)) and host_time > 0:
        set_wall_clock(float(host_time))
    if seed:
        reseed_rng(seed[:MAX_SEED_BYTES])
    if "volumes" in facts:  # the vm host's E2B volumes for this QEMU (agent/volumes.py)
        from aenv.agent import volumes

        volumes.apply(facts["volumes"])


async def serve(channel: str, accept: Connector, ready: Callable[[], None] | None = None,
                on_session: Callable[[], object] | None = None) -> None:
    """``on_session``: see :func:`serve_unix` (ns only; a vm guest's pages are QEMU's to merge)."""
    kind, _, path = channel.partition(":")
    if kind == "unix-listen" and path:
        await serve_unix(path, accept, ready, on_session)
    elif kind == "serial" and path:
        await serve_serial(path, accept, ready)
    else:
        raise ValueError(f"unknown channel {channel!r} (want unix-listen:PATH or serial:PATH)")

"""A new vm session must get a PONG, else it is reopened once (QEMU's throttled virtio-serial port)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from aenv.mux import MuxSession
from aenv.runtime.base import VolumeBind
from aenv.runtime.vm.sandbox import VmSandbox


class FakeMachine:
    """Hands out socketpairs; the guest end of the first ``dead`` ones never answers."""

    def __init__(self, dead: int) -> None:
        self.dead = dead
        self.opened = 0
        self.guests: list[Any] = []
        self.cfg = SimpleNamespace(share_dir=None)
        self.pid = os.getpid()

    async def wait_guest_channel(self, timeout: float) -> None:
        return None

    async def open_channel(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        host, guest = socket.socketpair()
        self.opened += 1
        gr, gw = await asyncio.open_unix_connection(sock=guest)
        if self.opened > self.dead:
            self.guests.append(await MuxSession(gr, gw, accept=_refuse, name="guest").start())
        else:
            self.guests.append((gr, gw))  # a throttled port: bytes go in, nothing comes back
        return await asyncio.open_unix_connection(sock=host)


async def _refuse(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    raise ConnectionRefusedError(port)


@pytest.mark.parametrize(("dead", "opened"), [(0, 1), (1, 2), (3, 4)])
async def test_session_reconnects_when_the_guest_does_not_answer(
    tmp_path: Path, dead: int, opened: int
) -> None:
    machine = FakeMachine(dead)
    sbx = VmSandbox("t", machine, tmp_path, "tpl")  # type: ignore[arg-type]
    sbx.first_ping = 0.05
    session = await sbx.session()
    await session.ping(timeout=1.0)
    assert machine.opened == opened
    assert await sbx.session() is session  # kept while alive
    await sbx.drop_session()
    for g in machine.guests:
        if isinstance(g, MuxSession):
            await g.aclose()
        else:
            g[1].close()


async def test_session_gives_up_after_the_second_silent_guest(tmp_path: Path) -> None:
    machine = FakeMachine(dead=5)
    sbx = VmSandbox("t", machine, tmp_path, "tpl")  # type: ignore[arg-type]
    sbx.first_ping, sbx.channel_timeout = 0.1, 0.2
    with pytest.raises(TimeoutError):
        await sbx.session()
    assert machine.opened == 2
    for _, w in machine.guests:
        w.close()


async def test_session_gives_up_after_the_channel_timeout(tmp_path: Path) -> None:
    """A guest that never answers: reconnects with doubling waits, then the timeout is raised."""
    machine = FakeMachine(dead=100)
    sbx = VmSandbox("t", machine, tmp_path, "tpl")  # type: ignore[arg-type]
    sbx.first_ping, sbx.channel_timeout = 0.02, 0.5
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(TimeoutError):
        await sbx.session()
    took = asyncio.get_running_loop().time() - t0
    assert 0.4 < took < 2.0 and 4 <= machine.opened <= 6  # 0.02 + 0.04 + 0.08 + 0.16 + 0.2 (rest)
    for g in machine.guests:
        g[1].close()


async def test_spare_envd_streams_are_used_first_and_dropped_with_the_session(tmp_path: Path) -> None:
    """A pool entry opens envd streams ahead (``open_spares``); ``open_stream`` hands them out
    before opening new ones, skips ones that died, and a dropped session takes them along."""
    from aenv.runtime.vm.sandbox import ENVD_PORT

    handlers: list[asyncio.Future[None]] = []

    async def echo_handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        done = asyncio.get_running_loop().create_future()
        handlers.append(done)
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        finally:
            w.close()
            done.set_result(None)

    echo = await asyncio.start_server(echo_handler, "127.0.0.1", 0)
    echo_port = echo.sockets[0].getsockname()[1]
    opened: list[asyncio.StreamWriter] = []

    async def echo_accept(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The guest agent's side: every port connects to the local echo server."""
        r, w = await asyncio.open_connection("127.0.0.1", echo_port)
        opened.append(w)
        return r, w

    class Machine(FakeMachine):
        async def open_channel(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            host, guest = socket.socketpair()
            gr, gw = await asyncio.open_unix_connection(sock=guest)
            self.guests.append(await MuxSession(gr, gw, accept=echo_accept, name="guest").start())
            return await asyncio.open_unix_connection(sock=host)

    sbx = VmSandbox("t", Machine(0), tmp_path, "tpl")  # type: ignore[arg-type]
    await sbx.open_spares(2)
    first, second = sbx.spare
    await second.aclose()  # died while waiting (the newest is handed out first)
    got = await sbx.open_stream(ENVD_PORT)
    assert got is first and sbx.spare == []
    await got.write(b"ping")
    assert await got.read() == b"ping"
    fresh = await sbx.open_stream(ENVD_PORT)  # none left: a new one
    assert fresh is not first and not fresh.closed
    await sbx.open_spares(1)
    await sbx.drop_session()
    assert sbx.spare == [] and fresh.closed
    for g in sbx.machine.guests:  # type: ignore[attr-defined]
        await g.aclose()
    for w in opened:
        w.close()
    await asyncio.wait_for(asyncio.gather(*handlers), 5)  # every echo connection ended on its side too
    echo.close()
    await echo.wait_closed()


def test_hello_names_the_qemu_and_its_volumes(tmp_path: Path) -> None:
    """The HELLO of a VM with a 9p export carries its volumes and an epoch that is this QEMU's:
    stable for one process (a plain resume changes nothing in the guest), another for another."""
    machine = FakeMachine(0)
    sbx = VmSandbox("t", machine, tmp_path, "tpl")  # type: ignore[arg-type]
    assert "volumes" not in json.loads(sbx.hello())  # no export (a config from before volumes)
    machine.cfg = SimpleNamespace(share_dir=tmp_path / "share")
    sbx.volumes = (VolumeBind(tmp_path / "v", "/data", read_only=True),)
    facts = json.loads(sbx.hello())
    assert facts["volumes"]["mounts"] == [{"slot": "vol-0", "path": "/data", "readOnly": True}]
    assert facts["volumes"]["epoch"].startswith(f"{os.getpid()}-") and json.loads(sbx.hello()) != facts  # new seed
    assert json.loads(sbx.hello())["volumes"] == facts["volumes"]
    other = VmSandbox("u", FakeMachine(0), tmp_path, "tpl")  # type: ignore[arg-type]
    other.machine.pid = 1  # type: ignore[attr-defined]
    other.machine.cfg = machine.cfg  # type: ignore[attr-defined]
    assert json.loads(other.hello())["volumes"]["epoch"] != facts["volumes"]["epoch"]

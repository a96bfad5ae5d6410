"""A new vm session must get a PONG, else it is reopened once (QEMU's throttled virtio-serial port)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import pytest

from aenv.mux import MuxSession
from aenv.runtime.vm.sandbox import VmSandbox


class FakeMachine:
    """Hands out socketpairs; the guest end of the first ``dead`` ones never answers."""

    def __init__(self, dead: int) -> None:
        self.dead = dead
        self.opened = 0
        self.guests: list[Any] = []

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


@pytest.mark.parametrize(("dead", "opened"), [(0, 1), (1, 2)])
async def test_session_reconnects_when_the_guest_does_not_answer(
    tmp_path: Path, dead: int, opened: int
) -> None:
    machine = FakeMachine(dead)
    sbx = VmSandbox("t", machine, tmp_path, "tpl")  # type: ignore[arg-type]
    sbx.first_ping = 0.2
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

"""The upstream pool (pool.py): which idle streams are reused, which are closed, and when.

Most tests hold fake streams whose state the test sets; the last two go through the proxy and a real mux.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from aenv.api.proxy import pool as pool_module
from aenv.api.proxy.pool import MAX_IDLE_PER_TARGET, UpstreamPool
from tests.unit.api.proxy.helpers import Exchange, respond


class FakeStream:
    """A ByteStream whose liveness the test sets."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.port = 0
        self.closed = False
        self.at_eof = False
        self.buffered = 0
        self.closes = 0

    async def read(self, n: int = -1) -> bytes:
        return b""

    async def write(self, data: bytes | bytearray | memoryview) -> None: ...

    async def write_eof(self) -> None: ...

    async def aclose(self) -> None:
        self.closes += 1
        self.closed = True


class Opener:
    """The orchestrator's open_stream: a new FakeStream per call, optionally held until ``gate`` is set."""

    def __init__(self) -> None:
        self.opened: list[tuple[str, int]] = []
        self.gate: asyncio.Event | None = None
        self.fail: Exception | None = None

    async def open_stream(self, sandbox_id: str, port: int) -> FakeStream:
        self.opened.append((sandbox_id, port))
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return FakeStream(f"{sandbox_id}:{port}#{len(self.opened)}")


@pytest.fixture
def opener() -> Opener:
    return Opener()


@pytest.fixture
def pool(opener: Opener) -> UpstreamPool:
    return UpstreamPool(lambda: opener)  # type: ignore[arg-type, return-value]


async def test_acquire_opens_then_reuses_most_recent_first(pool: UpstreamPool, opener: Opener) -> None:
    a, reused = await pool.acquire("s", 1)
    assert not reused and opener.opened == [("s", 1)]
    b, _ = await pool.acquire("s", 1)
    await pool.release("s", 1, a)
    await pool.release("s", 1, b)
    assert await pool.acquire("s", 1) == (b, True)
    assert await pool.acquire("s", 1) == (a, True)
    assert len(opener.opened) == 2
    c, reused = await pool.acquire("s", 2)  # another port of the same sandbox is another target
    assert not reused and c not in (a, b)


@pytest.mark.parametrize("state", ["closed", "at_eof", "buffered"])
async def test_unusable_stream_is_closed_not_kept(pool: UpstreamPool, opener: Opener, state: str) -> None:
    stream = FakeStream()
    setattr(stream, state, 3 if state == "buffered" else True)
    await pool.release("s", 1, stream)
    assert stream.closes == 1
    fresh, reused = await pool.acquire("s", 1)
    assert not reused and fresh is not stream


async def test_stream_that_died_while_idle_is_closed_at_acquire(pool: UpstreamPool) -> None:
    dead, alive = FakeStream("dead"), FakeStream("alive")
    await pool.release("s", 1, alive)
    await pool.release("s", 1, dead)
    dead.at_eof = True  # the sandbox side hung up after the release
    assert await pool.acquire("s", 1) == (alive, True)
    assert dead.closes == 1


async def test_expired_idle_stream_is_not_reused(
    pool: UpstreamPool, opener: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = FakeStream()
    await pool.release("s", 1, stream)
    monkeypatch.setattr(pool_module, "IDLE_EXPIRY", 0.0)
    fresh, reused = await pool.acquire("s", 1)
    assert not reused and fresh is not stream and stream.closes == 1


async def test_idle_streams_per_target_are_capped(pool: UpstreamPool) -> None:
    streams = [FakeStream(str(i)) for i in range(MAX_IDLE_PER_TARGET + 2)]
    for s in streams:
        await pool.release("s", 1, s)
    assert [s.closes for s in streams[:2]] == [1, 1]  # the oldest go
    assert not any(s.closes for s in streams[2:])
    for s in reversed(streams[2:]):
        assert await pool.acquire("s", 1) == (s, True)
    assert (await pool.acquire("s", 1))[1] is False


async def test_sweep_drops_dead_and_expired_streams_of_every_target(
    pool: UpstreamPool, opener: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    dead, kept = FakeStream("dead"), FakeStream("kept")
    await pool.release("gone", 1, dead)
    await pool.release("busy", 1, kept)
    dead.closed = True  # its sandbox was killed: nobody calls it again
    await pool.sweep()
    assert dead.closes == 1 and kept.closes == 0
    assert (await pool.acquire("gone", 1))[1] is False  # nothing kept for it
    monkeypatch.setattr(pool_module, "IDLE_EXPIRY", 0.0)
    await pool.sweep()
    assert kept.closes == 1


async def test_releases_sweep_every_so_often(pool: UpstreamPool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_module, "_SWEEP_EVERY", 4)
    dead = FakeStream("dead")
    await pool.release("gone", 1, dead)
    dead.at_eof = True
    for _ in range(2):
        await pool.release("busy", 1, FakeStream())
    assert dead.closes == 0
    await pool.release("busy", 1, FakeStream())  # the fourth release
    assert dead.closes == 1


async def test_prewarm_opens_once_and_the_request_waits_for_it(pool: UpstreamPool, opener: Opener) -> None:
    opener.gate = asyncio.Event()
    pool.prewarm("s", 1)
    pool.prewarm("s", 1)  # one in flight already: no second
    await asyncio.sleep(0)
    acquiring = asyncio.create_task(pool.acquire("s", 1))
    await asyncio.sleep(0.01)
    assert not acquiring.done() and opener.opened == [("s", 1)]
    opener.gate.set()
    stream, reused = await acquiring
    assert reused and opener.opened == [("s", 1)]


async def test_failed_prewarm_is_silent_and_the_request_opens_its_own(pool: UpstreamPool, opener: Opener) -> None:
    opener.gate, opener.fail = asyncio.Event(), ConnectionRefusedError("nothing there")
    pool.prewarm("s", 1)
    (prewarm,) = [t for t in asyncio.all_tasks() if t.get_name() == "proxy-prewarm-s"]
    acquiring = asyncio.create_task(pool.acquire("s", 1))  # waits for the prewarm, which then fails
    await asyncio.sleep(0.01)
    assert not acquiring.done()
    opener.gate.set()
    with pytest.raises(ConnectionRefusedError):  # from the request's own open, reported to it
        await acquiring
    assert len(opener.opened) == 2
    assert prewarm.done() and prewarm.exception() is None  # nothing left unretrieved


async def test_aclose_closes_idle_streams_and_cancels_prewarms(pool: UpstreamPool, opener: Opener) -> None:
    idle = FakeStream()
    await pool.release("s", 1, idle)
    opener.gate = asyncio.Event()
    pool.prewarm("s", 2)
    await asyncio.sleep(0)
    await pool.aclose()
    assert idle.closes == 1
    opener.gate.set()
    await asyncio.sleep(0.01)
    opener.gate = None
    assert (await pool.acquire("s", 2))[1] is False  # the cancelled prewarm kept nothing


# ---- through the proxy and a real mux ---------------------------------------------------------------


async def test_stale_keep_alive_stream_is_replaced(rig: Any) -> None:
    # The upstream claims keep-alive, then hangs up after each response: the next request must still work.
    proxy, orch, upstream = await rig(respond(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", requests=1))
    for _ in range(3):
        ex = Exchange(proxy)
        ex.body(b"")
        await ex.done()
        assert (ex.status, ex.content) == (200, b"ok")
        await asyncio.sleep(0.05)
    assert upstream.connections == 3


async def test_prewarmed_stream_serves_the_first_request(rig: Any) -> None:
    proxy, orch, upstream = await rig(respond(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"), port=49983)
    proxy.prewarm("sbx")
    # The request arrives while the prewarm is still opening: it waits for that stream, opens none.
    ex = Exchange(proxy, port=49983)
    ex.body(b"")
    await ex.done()
    assert (ex.status, ex.content) == (200, b"ok")
    assert orch.opened == 1 and upstream.connections == 1
    proxy.prewarm("nosuch")  # a failed prewarm is silent
    await asyncio.sleep(0.05)

"""The restore pool with a fake spawner: fills to size, hands out, refills, closes what it owns."""

from __future__ import annotations

import asyncio
from typing import Any

from aenv.runtime.vm.pool import RestorePool


class FakeSandbox:
    def __init__(self, name: str) -> None:
        self.name = name
        self.closed = False

    async def aclose(self) -> None:
        self.closed = True


async def test_fill_take_refill_close() -> None:
    made: list[FakeSandbox] = []

    async def spawn(name: str, key: str, allow: bool) -> Any:
        await asyncio.sleep(0)
        s = FakeSandbox(name)
        made.append(s)
        return s

    pool = RestorePool(2, spawn)
    assert pool.take("t", True) is None  # empty at first, but it starts filling
    for _ in range(50):
        await asyncio.sleep(0)
    assert len(pool.names()) == 2
    first = pool.take("t", True)
    assert first is not None and first.name not in pool.names()
    for _ in range(50):
        await asyncio.sleep(0)
    assert len(pool.names()) == 2 and len(made) == 3
    assert pool.take("t", False) is None  # other network mode, other entries
    await pool.aclose()
    assert [s.closed for s in made] == [False, True, True] + [True] * (len(made) - 3)


async def test_spawn_failures_stop_after_three() -> None:
    calls = 0

    async def spawn(name: str, key: str, allow: bool) -> Any:
        nonlocal calls
        calls += 1
        raise RuntimeError("no qemu")

    pool = RestorePool(2, spawn)
    pool.want("t", True)
    for _ in range(20):
        await asyncio.sleep(0)
    assert calls == 3 and pool.names() == set()
    await pool.aclose()


async def test_size_zero_never_spawns() -> None:
    async def spawn(name: str, key: str, allow: bool) -> Any:
        raise AssertionError("must not spawn")

    pool = RestorePool(0, spawn)
    assert pool.take("t", True) is None
    await pool.aclose()


async def test_take_without_refill_waits_for_want() -> None:
    """A restore into a pre-spawned process refills the pool only when it is done (``want``), so
    the replacement does not compete with the restore for the CPU."""
    made: list[str] = []

    async def spawn(name: str, key: str, allow: bool) -> Any:
        made.append(name)
        return FakeSandbox(name)

    pool = RestorePool(1, spawn)
    pool.want("t", True)
    for _ in range(20):
        await asyncio.sleep(0)
    assert pool.take("t", True, refill=False) is not None
    for _ in range(20):
        await asyncio.sleep(0)
    assert len(made) == 1 and pool.names() == set()
    pool.want("t", True)
    for _ in range(20):
        await asyncio.sleep(0)
    assert len(made) == 2 and len(pool.names()) == 1
    await pool.aclose()

from __future__ import annotations

import asyncio
from pathlib import Path

from aenv.runtime.base import SandboxImage
from aenv.runtime.ns.pool import WarmPool, pool_key


class FakeSandbox:
    def __init__(self, n: int) -> None:
        self.name = f"pool-{n}"
        self.dead = False
        self.closed = False
        self.uid_slot = 0

    def alive(self) -> bool:
        return not self.dead

    async def aclose(self) -> None:
        self.closed = True


def make_pool(size: int) -> tuple[WarmPool, list[FakeSandbox]]:
    made: list[FakeSandbox] = []

    async def factory(template: SandboxImage, net: bool, uid_slot: int) -> FakeSandbox:
        await asyncio.sleep(0)
        sbx = FakeSandbox(len(made))
        sbx.uid_slot = uid_slot
        made.append(sbx)
        return sbx

    return WarmPool(size, factory), made  # type: ignore[arg-type]


T = SandboxImage("t", Path("/r"))


def test_pool_key_separates_network_modes_and_templates() -> None:
    assert pool_key(T, True) != pool_key(T, False)
    assert pool_key(T, True) != pool_key(SandboxImage("u", Path("/r")), True)
    assert pool_key(T, True) == pool_key(T, True, 0) != pool_key(T, True, 3)  # a team's uid range


async def test_a_team_range_never_gets_another_ranges_entries() -> None:
    pool, made = make_pool(1)
    pool.want(T, False)  # slot 0 (the shared range) hot and filled
    await pool.wait_ready(T, False)
    assert pool.take(T, False, uid_slot=2) is None  # a team of its own range: nothing for it yet
    await pool.wait_ready(T, False, uid_slot=2)
    got = pool.take(T, False, uid_slot=2)
    assert got is not None and got.uid_slot == 2
    assert pool.ready_count(T, False) == 1 and pool.take(T, False).uid_slot == 0  # type: ignore[union-attr]
    await pool.aclose()


async def test_first_take_misses_then_refills() -> None:
    pool, made = make_pool(2)
    assert pool.take(T, False) is None  # cold: marks the key hot
    await pool.wait_ready(T, False)
    assert pool.ready_count(T, False) == 2
    got = pool.take(T, False)
    assert got is made[0]
    await pool.wait_ready(T, False)
    assert len(made) == 3  # refilled after the take
    assert pool.ready_count(T, True) == 0  # other network mode untouched
    await pool.aclose()
    assert all(s.closed for s in made[1:])


async def test_dead_pooled_sandbox_is_skipped() -> None:
    pool, made = make_pool(1)
    await pool.wait_ready(T, False) if pool.want(T, False) is None else None
    made[0].dead = True
    got = pool.take(T, False)
    assert got is None
    await asyncio.sleep(0)
    assert made[0].closed
    await pool.aclose()


async def test_size_zero_never_fills() -> None:
    pool, made = make_pool(0)
    assert pool.take(T, False) is None
    await asyncio.sleep(0.01)
    assert made == []


async def test_forget_kills_ready_and_stops_refilling() -> None:
    pool, made = make_pool(2)
    other = SandboxImage("other", Path("/o"))
    pool.want(T, False)
    pool.want(other, False)
    await pool.wait_ready(T, False)
    await pool.wait_ready(other, False)
    await pool.forget("t")
    assert pool.ready_count(T, False) == 0 and pool.ready_count(other, False) == 2
    assert sum(s.closed for s in made) == 2
    await pool.aclose()


async def test_ready_counts_are_per_template_over_network_modes() -> None:
    pool, _ = make_pool(2)
    assert pool.ready_counts() == {}
    for net in (True, False):
        pool.want(T, net)
        await pool.wait_ready(T, net)
    pool.take(T, True)  # one handed out: counted again only once refilled
    assert pool.ready_counts() == {"t": 3}
    await pool.aclose()


async def test_an_emptied_pool_refills_several_at_once_and_without_delay() -> None:
    """A pool taken empty starts its whole lack at once (bounded by the parallel starts), not one
    after another after the refill delay: its next create would otherwise pay a whole start."""
    running, peak = 0, 0
    made: list[FakeSandbox] = []

    async def slow_factory(template: SandboxImage, net: bool, uid_slot: int) -> FakeSandbox:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.05)
        running -= 1
        made.append(FakeSandbox(len(made)))
        return made[-1]

    pool = WarmPool(3, slow_factory, max_parallel=2, refill_delay=10.0)  # type: ignore[arg-type]
    pool.want(T, False)
    await asyncio.wait_for(pool.wait_ready(T, False), 2)  # no 10 s delay before filling an empty pool
    assert peak == 2  # two at a time: the parallel bound
    assert pool.take(T, False) is made[0]
    await asyncio.sleep(0.2)
    assert len(made) == 3  # one left in the pool: the refill waits its delay
    await pool.aclose()


async def test_a_failed_start_in_a_parallel_refill_keeps_the_others() -> None:
    calls = 0

    async def flaky(template: SandboxImage, net: bool, uid_slot: int) -> FakeSandbox:
        nonlocal calls
        calls += 1
        mine = calls
        await asyncio.sleep(0)
        if mine == 1:
            raise RuntimeError("restore failed")
        return FakeSandbox(mine)

    pool = WarmPool(2, flaky, max_parallel=2)  # type: ignore[arg-type]
    pool.want(T, False)
    await asyncio.sleep(0.05)
    assert pool.ready_count(T, False) == 1  # the one that started is kept while the retry backs off
    await pool.aclose()


async def test_a_fill_cancelled_midway_closes_what_it_had_made() -> None:
    """The pool closes while an emptied pool's parallel refill runs: a start that was already done must
    not be dropped with its sandbox running (the clean-clone run's leftover agent, envd and slirp4netns)."""
    made: list[FakeSandbox] = []
    slow_started = asyncio.Event()

    async def factory(template: SandboxImage, net: bool, uid_slot: int) -> FakeSandbox:
        n = len(made) + (1 if slow_started.is_set() else 0)
        if n == 0:
            slow_started.set()
            await asyncio.sleep(10)  # the second start: still under way when the pool closes
        sbx = FakeSandbox(len(made))
        made.append(sbx)
        return sbx

    pool = WarmPool(2, factory, max_parallel=2)  # type: ignore[arg-type]
    pool.want(T, False)
    await asyncio.wait_for(slow_started.wait(), 1)
    for _ in range(100):
        if made:
            break
        await asyncio.sleep(0.01)
    assert len(made) == 1 and pool.ready_count(T, False) == 1  # one done and ready, one under way
    await asyncio.wait_for(pool.aclose(), 2)
    assert made[0].closed  # not left running


async def test_a_take_during_a_refill_starts_the_next_at_once() -> None:
    """The pool keeps its whole lack in flight: a take while a refill is under way starts another
    then, not after the first ends (during another team's burst a start takes 200-500 ms, and a
    create every ~0.2 s emptied a pool refilled one start after another)."""
    running = 0
    release = asyncio.Event()
    made: list[FakeSandbox] = []

    async def gated(template: SandboxImage, net: bool, uid_slot: int) -> FakeSandbox:
        nonlocal running
        running += 1
        await release.wait()
        running -= 1
        made.append(FakeSandbox(len(made)))
        return made[-1]

    pool = WarmPool(2, gated, max_parallel=2, refill_delay=0.0)  # type: ignore[arg-type]
    pool.want(T, False)
    for _ in range(100):
        if running == 2:
            break
        await asyncio.sleep(0.001)
    release.set()
    await asyncio.wait_for(pool.wait_ready(T, False), 2)
    release.clear()
    assert pool.take(T, False) is not None  # one left: one refill starts, and waits on the gate
    await asyncio.sleep(0.01)
    assert running == 1
    assert pool.take(T, False) is not None  # the last one, while the refill is still under way
    await asyncio.sleep(0.01)
    assert running == 2  # the second start began now, beside the first
    release.set()
    await asyncio.wait_for(pool.wait_ready(T, False), 2)
    assert len(made) == 4
    await pool.aclose()


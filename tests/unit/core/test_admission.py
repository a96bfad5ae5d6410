"""Admission of creates (core/admission.py): bursts wait, fairly per group; bounds answer readable 429s."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from aenv.config import Settings
from aenv.core.admission import Admission, owner_of
from aenv.core.table import SandboxTable
from aenv.errors import CapacityError


def _admission(**knobs: object) -> Admission:
    return Admission(Settings(**knobs), SandboxTable())  # type: ignore[arg-type]


async def _ticks(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def _holder(adm: Admission, hold: asyncio.Event) -> Callable[[], Awaitable[None]]:
    """A create that keeps its slot until ``hold`` is set."""

    async def create() -> None:
        async with adm.slot("k", None):
            await hold.wait()

    return create


async def test_waiters_are_served_round_robin_across_groups() -> None:
    adm = _admission(max_concurrent_starts=1)
    order: list[str] = []
    gate = asyncio.Event()

    async def create(owner: str, run: str, name: str, hold: asyncio.Event | None = None) -> None:
        async with adm.slot(owner, run):
            order.append(name)
            if hold is not None:
                await hold.wait()

    first = asyncio.create_task(create("k", "A", "A0", gate))
    await _ticks()
    tasks = [asyncio.create_task(create("k", "A", f"A{i}")) for i in range(1, 5)]
    await _ticks()
    tasks += [asyncio.create_task(create("k", "B", f"B{i}")) for i in range(1, 3)]
    tasks += [asyncio.create_task(create("other-key", "A", "K1"))]
    await _ticks()
    assert adm.starting == 1 and adm.waiting == 7
    gate.set()
    await asyncio.gather(first, *tasks)
    # one run's burst does not starve another run, nor another key's create of the same run name
    assert order == ["A0", "A1", "B1", "K1", "A2", "B2", "A3", "A4"]
    assert adm.starting == 0 and adm.waiting == 0


async def test_full_queue_and_long_wait_are_capacity_refusals() -> None:
    adm = _admission(max_concurrent_starts=1, admission_queue=1, admission_wait=0.2)
    hold = asyncio.Event()
    create = _holder(adm, hold)
    running = asyncio.create_task(create())
    await _ticks()
    waiting = asyncio.create_task(create())
    await _ticks()
    with pytest.raises(CapacityError) as full:
        await create()
    assert full.value.reason == "capacity" and "queue holds 1" in full.value.message and full.value.retry_after >= 1
    with pytest.raises(CapacityError) as slow:
        await waiting
    assert slow.value.reason == "capacity" and "waited" in slow.value.message
    assert adm.waiting == 0
    hold.set()
    await running
    assert adm.starting == 0


async def test_a_cancelled_waiter_gives_its_place_back() -> None:
    adm = _admission(max_concurrent_starts=1)
    hold = asyncio.Event()
    create = _holder(adm, hold)
    running = asyncio.create_task(create())
    await _ticks()
    gone = asyncio.create_task(create())
    await _ticks()
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    assert adm.waiting == 0
    hold.set()
    await running
    assert adm.starting == 0
    async with adm.slot("k", None):  # the slot is free again at once
        assert adm.starting == 1


async def test_key_quota_counts_live_and_starting() -> None:
    adm = _admission(key_quotas={"secret-key": 2}, default_key_quota=5)
    me = owner_of("secret-key")
    async with adm.slot(me, None):
        adm.owns(me, "s1")
    adm.table.ids = lambda: {"s1"}  # type: ignore[method-assign]  # s1 lives
    async with adm.slot(me, None):
        with pytest.raises(CapacityError) as over:
            async with adm.slot(me, None):
                pass
    assert over.value.reason == "quota" and "quota is 2" in over.value.message
    adm.table.ids = lambda: set()  # type: ignore[method-assign]  # s1 ended
    async with adm.slot(me, None):
        pass
    assert adm.quota_for(owner_of("someone else")) == 5
    assert _admission(key_quotas={"sha256:" + me: 3}).quota_for(me) == 3

"""Admission of creates (core/admission.py): bursts wait, fairly per group; bounds answer readable 429s."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from aenv.config import Settings
from aenv.core.admission import Admission
from aenv.core.table import LiveSandbox, SandboxTable
from aenv.errors import CapacityError, QuotaExceeded
from aenv.kinds import SandboxState
from aenv.store.sqlite import SandboxRow
from aenv.teams import Principal, TeamSpec
from aenv.teams import digest as owner_of


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
    # teams take turns first (k, other-key), then the runs of a team (A, B): one run's burst starves
    # neither another run nor another team's create
    assert order == ["A0", "A1", "K1", "B1", "A2", "B2", "A3", "A4"]
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


def _live(adm: Admission, owner: str, sandbox_id: str, cpus: int = 1, memory_mb: int = 512) -> None:
    """A sandbox of ``owner``'s team in the table (what admission counts a team's holdings from)."""
    row = SandboxRow(id=sandbox_id, template_id="base", state=SandboxState.RUNNING, runtime="ns", started_at=0.0,
                     end_at=1.0, cpu_count=cpus, memory_mb=memory_mb, disk_mb=512, owner=owner)  # fmt: skip
    adm.table.add(LiveSandbox(row=row, spec=None))  # type: ignore[arg-type]


async def test_key_quota_counts_the_teams_sandboxes() -> None:
    adm = _admission(api_keys=["secret-key", "other"], key_quotas={"secret-key": 2}, default_key_quota=5)
    me = owner_of("secret-key")
    _live(adm, me, "s1")
    async with adm.slot(me, None):
        _live(adm, me, "s2")
    with pytest.raises(QuotaExceeded) as over:
        async with adm.slot(me, None):
            pass
    assert over.value.reason == "quota" and over.value.quota == "max_sandboxes" and over.value.limit == 2
    assert "max_sandboxes = 2" in over.value.message and not over.value.hard
    adm.table.discard("s1")  # s1 ended
    async with adm.slot(me, None):
        pass
    assert adm.quota_for(owner_of("other")) == 5
    assert _admission(api_keys=["secret-key"], key_quotas={"sha256:" + me: 3}).quota_for(me) == 3


async def test_vcpu_and_memory_quotas_and_the_hard_refusal() -> None:
    adm = _admission(teams={"rl": TeamSpec(keys=["k1"], max_vcpus=4, max_memory_mb=4096)}, api_keys=["k2"])
    _live(adm, "rl", "a", cpus=2, memory_mb=1024)
    adm.check_quota("rl", 1, 2, 1024)  # 4 vCPUs in all: fits
    _live(adm, "rl", "b", cpus=2, memory_mb=1024)
    with pytest.raises(QuotaExceeded) as cpu:
        adm.check_quota("rl", 1, 1, 256)
    assert cpu.value.quota == "max_vcpus" and cpu.value.limit == 4 and not cpu.value.hard
    with pytest.raises(QuotaExceeded) as alone:
        adm.check_quota("rl", 1, 8, 256)  # no kill would make 8 vCPUs fit in 4: a hard refusal (403)
    assert alone.value.hard and alone.value.quota == "max_vcpus"
    adm.table.discard("b")
    with pytest.raises(QuotaExceeded) as mem:
        adm.check_quota("rl", 2, 2, 3500)
    assert mem.value.quota == "max_memory_mb"
    adm.check_quota(owner_of("k2"), 10, 100, 100_000)  # another team: no limits of its own
    assert {(t, q) for t, q in adm.refusals} == {("rl", "max_vcpus"), ("rl", "max_memory_mb")}


async def test_creates_per_second_is_a_token_bucket() -> None:
    adm = _admission(teams={"rl": TeamSpec(keys=["k1"], creates_per_second=2)}, api_keys=["k2"])
    for _ in range(2):  # a burst of one second's worth
        async with adm.slot("rl", None):
            pass
    with pytest.raises(QuotaExceeded) as fast:
        async with adm.slot("rl", None):
            pass
    assert fast.value.quota == "creates_per_second" and 0 < fast.value.retry_after <= 0.5
    async with adm.slot(owner_of("k2"), None):  # the other team is not slowed
        pass
    await asyncio.sleep(0.55)
    async with adm.slot("rl", None):  # refilled
        pass


def test_teams_from_settings() -> None:
    teams = Settings(api_keys=["a", "b"], teams={"rl": TeamSpec(keys=["c", "sha256:" + owner_of("d")])},
                     admin_keys=["root"]).team_directory()
    assert teams.resolve("a") == Principal(owner_of("a")) and teams.resolve("b") == Principal(owner_of("b"))
    assert teams.resolve("c") == teams.resolve("d") == Principal("rl")
    assert teams.resolve("root") == Principal("admin", admin=True) and teams.resolve("nope") is None
    alone = Settings(api_keys=["a"]).team_directory()  # one team, no admin: its key is the operator too
    assert alone.resolve("a") == Principal(owner_of("a"), admin=True)
    with pytest.raises(ValueError, match="already given to team"):
        Settings(teams={"x": TeamSpec(keys=["k"]), "y": TeamSpec(keys=["k"])})
    with pytest.raises(ValueError, match="team name"):
        Settings(teams={"Bad Name": TeamSpec(keys=["k"])})
    assert Settings().team_directory().resolve(None) == Principal("", admin=True)  # no keys: open


async def test_a_teams_burst_leaves_start_slots_for_another_team() -> None:
    adm = _admission(teams={"a": TeamSpec(keys=["ka"]), "b": TeamSpec(keys=["kb"])}, max_concurrent_starts=4,
                     team_concurrent_starts=3)
    assert adm.team_cap == 3
    assert _admission(teams={"a": TeamSpec(keys=["ka"]), "b": TeamSpec(keys=["kb"])}, max_concurrent_starts=4,
                      team_concurrent_starts=9).team_cap == 3  # one slot always left for another team
    hold = asyncio.Event()

    async def create(team: str) -> None:
        async with adm.slot(team, None):
            await hold.wait()

    burst = [asyncio.create_task(create("a")) for _ in range(6)]
    await _ticks()
    assert adm.starting == 3 and adm.waiting == 3  # a holds its share; one slot stays free
    assert adm.in_burst("a") and not adm.in_burst("b")  # a's burst starts fresh; the pool stays for b
    b = asyncio.create_task(create("b"))
    await _ticks()
    assert adm.starting == 4 and adm.waiting == 3  # b started at once, without waiting behind a's queue
    hold.set()
    await asyncio.gather(b, *burst)
    assert adm.starting == 0 and adm.waiting == 0
    assert not _admission(max_concurrent_starts=4).in_burst("a")  # one team: the pool is all its own


async def test_a_burst_yields_only_while_another_team_has_a_create_in_flight() -> None:
    """``contended`` goes on when another team's create comes during a burst, off when it is done (not when
    the burst is), and the runtime hears each change once (``on_contention``)."""
    teams = {"a": TeamSpec(keys=["ka"]), "b": TeamSpec(keys=["kb"]), "c": TeamSpec(keys=["kc"])}
    adm = _admission(teams=teams, max_concurrent_starts=6, team_concurrent_starts=3)
    heard: list[bool] = []
    adm.on_contention = heard.append
    holds = {t: asyncio.Event() for t in ("a", "b", "c")}

    async def create(team: str) -> None:
        async with adm.slot(team, None):
            await holds[team].wait()

    a1 = asyncio.create_task(create("a"))
    b1 = asyncio.create_task(create("b"))
    await _ticks()
    assert not adm.contended() and heard == []  # two lone creates: nobody bursts
    burst = [asyncio.create_task(create("a")) for _ in range(5)]
    await _ticks()
    assert adm.contended() and heard == [True]  # a bursts (3 slots, 3 waiting) while b's create is in flight
    holds["b"].set()
    await b1
    await _ticks()
    assert not adm.contended() and heard == [True, False]  # b done: a's burst has the CPU back
    holds["b"].clear()
    b2 = asyncio.create_task(create("b"))
    await _ticks()
    assert heard == [True, False, True]
    holds["c"].set()
    await create("c")  # a third team's create in and out while b's is still in flight: no change heard
    assert heard == [True, False, True]
    holds["b"].set()
    await b2
    holds["a"].set()
    await asyncio.gather(a1, *burst)
    assert adm.starting == 0 and adm.waiting == 0 and not adm.contended()
    assert heard == [True, False, True, False]


async def test_two_bursts_or_one_team_never_yield() -> None:
    adm = _admission(teams={"a": TeamSpec(keys=["ka"]), "b": TeamSpec(keys=["kb"])}, max_concurrent_starts=6,
                     team_concurrent_starts=3)
    heard: list[bool] = []
    adm.on_contention = heard.append
    hold = asyncio.Event()

    async def create(team: str) -> None:
        async with adm.slot(team, None):
            await hold.wait()

    tasks = [asyncio.create_task(create(t)) for t in ("a", "a", "b", "b")]
    await _ticks()
    # b's first create came during a's burst (a gave way), its second made b a burst too: neither gives way
    assert adm.starting == 4 and not adm.contended() and heard == [True, False]
    hold.set()
    await asyncio.gather(*tasks)
    hold.clear()
    assert not adm.contended() and heard[-1] is False
    alone = _admission(max_concurrent_starts=6)  # one team (no teams configured)
    alone.on_contention = heard.append
    heard.clear()
    tasks = [asyncio.create_task(_holder(alone, hold)()) for _ in range(4)]
    await _ticks()
    assert not alone.contended() and heard == []
    hold.set()
    await asyncio.gather(*tasks)

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


async def test_drop_template_ends_its_entries_and_spawns_in_flight() -> None:
    """Both network modes of the template go, ready and still spawning (the spawner is cancelled
    and closes what it started); other templates' entries stay; a later want fills it again."""
    made: list[FakeSandbox] = []
    started: list[str] = []
    release = asyncio.Event()

    async def spawn(name: str, key: str, allow: bool) -> Any:
        started.append(key)
        if key == "slow":
            await release.wait()  # never set: still spawning when the template goes
        s = FakeSandbox(f"{key}-{allow}-{name}")
        made.append(s)
        return s

    pool = RestorePool(1, spawn)
    for key, allow in (("t", True), ("t", False), ("other", True), ("slow", True)):
        pool.want(key, allow)
    for _ in range(50):
        await asyncio.sleep(0)
    assert pool.template_keys() == {"t", "other", "slow"}
    await pool.drop_template("t")
    await pool.drop_template("slow")
    assert pool.template_keys() == {"other"}
    assert sorted(s.name.split("-pool")[0] for s in made if s.closed) == ["t-False", "t-True"]
    assert [s.name.split("-pool")[0] for s in made if not s.closed] == ["other-True"]
    assert pool.take("t", True, refill=False) is None and started.count("slow") == 1
    pool.want("t", True)
    for _ in range(50):
        await asyncio.sleep(0)
    assert pool.template_keys() == {"other", "t"}
    await pool.aclose()
    assert all(s.closed for s in made)


async def test_forget_template_drops_both_pools_entries_of_that_template_only(tmp_path: Any) -> None:
    """``VmRuntime.forget_template``: the warm and blank pool entries of every template built from
    the id (any shape: the pool keys are template keys) go; a template whose id merely starts the
    same stays."""
    from aenv.config import Settings
    from aenv.runtime.vm.runtime import VmRuntime

    made: list[FakeSandbox] = []

    async def spawn(name: str, key: str, allow: bool) -> Any:
        s = FakeSandbox(key)
        made.append(s)
        return s

    rt = VmRuntime(Settings(state_dir=tmp_path, cache_dir=tmp_path / "cache"), pool_size=1)
    rt.pool, rt.blank_pool = RestorePool(1, spawn), RestorePool(1, spawn)
    keys = ["code-interpreter-0123456789ab", "code-interpreter-ba9876543210", "code-interpreter-v1-0123456789ab"]
    for key in keys:
        rt.pool.want(key, True)
        rt.blank_pool.want(key, False)
    for _ in range(50):
        await asyncio.sleep(0)
    await rt.forget_template("code-interpreter")
    assert rt.pool.template_keys() == rt.blank_pool.template_keys() == {keys[2]}
    assert sorted(s.name for s in made if s.closed) == sorted(keys[:2] * 2)
    await rt.pool.aclose()
    await rt.blank_pool.aclose()


async def test_warm_counts_are_per_template_id_of_the_ready_entries(tmp_path: Any) -> None:
    """``VmRuntime.warm_counts`` (``/aenv/info`` ``warm``): ready warm entries per template ID, every
    shape and network mode of it together; blank entries and unknown keys are not counted."""
    from aenv.config import Settings
    from aenv.runtime.vm.runtime import VmRuntime

    async def spawn(name: str, key: str, allow: bool) -> Any:
        return FakeSandbox(key)

    rt = VmRuntime(Settings(state_dir=tmp_path, cache_dir=tmp_path / "cache"), pool_size=1)
    rt.pool, rt.blank_pool = RestorePool(1, spawn), RestorePool(1, spawn)
    rt._template_ids.update({"base-0123456789ab": "base", "base-ba9876543210": "base"})
    for key, allow in [("base-0123456789ab", True), ("base-0123456789ab", False), ("base-ba9876543210", True),
                       ("never-asked-0123456789ab", True)]:  # fmt: skip
        rt.pool.want(key, allow)
    rt.blank_pool.want("base-0123456789ab", True)
    for _ in range(50):
        await asyncio.sleep(0)
    assert rt.warm_counts() == {"base": 3}
    await rt.pool.aclose()
    await rt.blank_pool.aclose()

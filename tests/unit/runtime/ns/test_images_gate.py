"""``runtime/ns/images_gate.py``: restores and the page linker take turns, restores first."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aenv.runtime.ns.images_gate import ImagesGate

IMAGES = Path("/s/a/criu")


def test_the_linker_waits_for_restores_running_and_asked_in_its_grace() -> None:
    async def main() -> list[str]:
        gate, order = ImagesGate(), []

        async def restore(name: str, after: float, hold: float) -> None:
            await asyncio.sleep(after)
            async with gate.reading(IMAGES):
                order.append(f"{name} in")
                await asyncio.sleep(hold)
                order.append(f"{name} out")

        async def link() -> None:
            async with gate.writing(IMAGES, grace=0.02):
                order.append("link in")
                await asyncio.sleep(0.02)
                order.append("link out")

        await asyncio.gather(link(), restore("a", 0.0, 0.05), restore("b", 0.01, 0.05), restore("late", 0.08, 0.0))
        return order

    order = asyncio.run(main())
    assert order.index("link in") > max(order.index("a out"), order.index("b out"))  # a, b went first
    assert order.index("late in") > order.index("link out")  # asked while it linked: waited
    assert order.count("link in") == 1


def test_other_images_are_not_held_back_and_a_cancelled_waiter_leaves_no_count() -> None:
    async def main() -> bool:
        gate = ImagesGate()
        async with gate.writing(IMAGES, grace=0):
            async with gate.reading(Path("/s/b/criu")):  # another snapshot's: no wait
                pass
            waiter = asyncio.ensure_future(gate.reading(IMAGES).__aenter__())
            await asyncio.sleep(0.01)
            assert not waiter.done()
            waiter.cancel()
        await asyncio.wait_for(gate.writing(IMAGES, grace=0).__aenter__(), 1)  # nobody reads: in at once
        return True

    assert asyncio.run(main())

"""Restores and the page linker take turns on a dump's images, restores first.

A restore reads a full snapshot's CRIU images while ``image_links.link_unchanged`` may be rewriting
them (pagemaps switched to parent references, page files replaced): never both at once. A fork
restores its children from the fork point the moment it is taken, and each of them waiting for the
linker cost ~40 ms of the fork, so the linker gives way: it starts after a grace period, then waits
until no restore reads the images, and only restores asked while it runs wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path

LINK_GRACE_S = 0.5  # a fork's restores are asked within milliseconds of its snapshot


class ImagesGate:
    """Readers (restores) and one writer (the linker) per images directory. State changes are
    synchronous (one event loop), so a cancelled waiter never leaves a count behind."""

    def __init__(self) -> None:
        self._reading: Counter[Path] = Counter()
        self._writing: set[Path] = set()
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _until(self, ready: Callable[[], bool]) -> None:
        while True:
            changed = self._changed
            if ready():
                return
            await changed.wait()

    @contextlib.asynccontextmanager
    async def reading(self, images: Path) -> AsyncIterator[None]:
        await self._until(lambda: images not in self._writing)
        self._reading[images] += 1
        try:
            yield
        finally:
            self._reading[images] -= 1
            if not self._reading[images]:
                del self._reading[images]
            self._notify()

    @contextlib.asynccontextmanager
    async def writing(self, images: Path, grace: float = LINK_GRACE_S) -> AsyncIterator[None]:
        await asyncio.sleep(grace)
        await self._until(lambda: not self._reading.get(images) and images not in self._writing)
        self._writing.add(images)
        try:
            yield
        finally:
            self._writing.discard(images)
            self._notify()

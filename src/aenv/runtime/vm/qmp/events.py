"""Scoped QMP event listeners: each has its own queue and name filter and lives inside a ``with``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from .message import Message


class EventListener:
    """Collects events whose name is in ``names`` (all events when ``names`` is empty).

    Register with :meth:`QMPClient.listen` (a context manager) so it is always removed again.
    The queue is unbounded on purpose: QEMU emits few events and dropping one (e.g. ``STOP``)
    would make a waiter hang.
    """

    def __init__(self, names: Iterable[str] = ()) -> None:
        self.names = frozenset(names)
        self._queue: asyncio.Queue[Message] = asyncio.Queue()

    def accepts(self, event: Message) -> bool:
        return not self.names or event.get("event") in self.names

    def put(self, event: Message) -> None:
        self._queue.put_nowait(event)

    async def get(self) -> Message:
        """The next matching event, oldest first."""
        return await self._queue.get()

    async def wait_for(self, name: str, predicate: Any = None) -> Message:
        """Discard events until one named ``name`` (and passing ``predicate``) arrives."""
        while True:
            ev = await self.get()
            if ev.get("event") == name and (predicate is None or predicate(ev)):
                return ev

    def drain(self) -> list[Message]:
        """Everything queued so far, without waiting."""
        out: list[Message] = []
        while not self._queue.empty():
            out.append(self._queue.get_nowait())
        return out

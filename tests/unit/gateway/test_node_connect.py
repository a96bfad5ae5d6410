"""The sandbox proxy's connection to a node: one that takes none in time marks the node down."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from aenv.gateway import proxy


def test_a_node_that_does_not_answer_the_connect_is_marked_down(monkeypatch: pytest.MonkeyPatch) -> None:
    node = SimpleNamespace(host="10.255.0.9", port=1)
    downs: list[tuple[Any, str]] = []

    async def never(host: str, port: int, sandbox_port: int) -> None:
        await asyncio.sleep(3600)

    monkeypatch.setattr(proxy, "open_tcp", never)
    monkeypatch.setattr(proxy, "CONNECT_TIMEOUT", 0.05)
    opener = proxy._ToNode(SimpleNamespace(cached=lambda sid: node),  # type: ignore[arg-type]
                           SimpleNamespace(mark_down=lambda n, why: downs.append((n, why))))  # type: ignore[arg-type]
    with pytest.raises(TimeoutError):
        asyncio.run(opener.open_stream("sbx1", 49983))
    assert downs == [(node, "TimeoutError: no answer in 0.05 s")]

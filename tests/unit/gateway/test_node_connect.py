"""The sandbox proxy's connection to a node: one that takes none in time marks the node down."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from aenv.api.proxy.routing import HopDown, upstream_error
from aenv.gateway import proxy


def test_a_node_that_does_not_answer_the_connect_is_marked_down(monkeypatch: pytest.MonkeyPatch) -> None:
    node = SimpleNamespace(id="n2", url="http://10.255.0.9:1", host="10.255.0.9", port=1)
    downs: list[tuple[Any, str]] = []

    async def never(host: str, port: int, sandbox_port: int) -> None:
        await asyncio.sleep(3600)

    monkeypatch.setattr(proxy, "open_tcp", never)
    monkeypatch.setattr(proxy, "CONNECT_TIMEOUT", 0.05)
    opener = proxy._ToNode(SimpleNamespace(cached=lambda sid: node),  # type: ignore[arg-type]
                           SimpleNamespace(mark_down=lambda n, why: downs.append((n, why))))  # type: ignore[arg-type]
    with pytest.raises(HopDown) as err:
        asyncio.run(opener.open_stream("sbx1", 49983))
    assert downs == [(node, "TimeoutError: no answer in 0.05 s")]
    assert isinstance(err.value.__cause__, TimeoutError)


def test_a_refused_connect_to_the_node_answers_a_502_that_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The node's machine died: the SDK's exception carries the 502's message, which says which node and
    why (E2B's "is unreachable" words first, so the SDK still raises SandboxUnreachableException)."""
    node = SimpleNamespace(id="n2", url="http://10.255.0.9:8000", host="10.255.0.9", port=8000)

    async def refuse(host: str, port: int, sandbox_port: int) -> None:
        raise ConnectionRefusedError(111, "Connect call failed")

    monkeypatch.setattr(proxy, "open_tcp", refuse)
    opener = proxy._ToNode(SimpleNamespace(cached=lambda sid: node),  # type: ignore[arg-type]
                           SimpleNamespace(mark_down=lambda n, why: None))  # type: ignore[arg-type]
    with pytest.raises(HopDown) as err:
        asyncio.run(opener.open_stream("sbx1", 49983))
    status, body = upstream_error("sbx1", err.value)
    got = json.loads(body)
    assert status == 502 and (got["reason"], got["node"]) == ("node_down", "n2")
    assert got["message"] == ("The sandbox is unreachable: its node n2 (http://10.255.0.9:8000) took no connection: "
                              "ConnectionRefusedError: [Errno 111] Connect call failed")

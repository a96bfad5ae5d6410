"""The simulated node's pure parts: HTTP heads in and out, latencies, warm sets, the capacity refusal the
gateway retries on, the controller's death rule, and a node's routes without a listener."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from aenv.testing import simnode
from aenv.testing.simnode import SimConfig, SimNode


def test_parse_head() -> None:
    method, path, query, headers = simnode.parse_head(
        b"POST /v2/sandboxes?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 12\r\nX-API-KEY: k")
    assert (method, path, query) == ("POST", "/v2/sandboxes", "x=1")
    assert headers == {"host": "a", "content-length": "12", "x-api-key": "k"}
    with pytest.raises(ValueError):
        simnode.parse_head(b"garbage")
    with pytest.raises(ValueError):
        simnode.parse_head(b"GET / HTTP/1.1\r\nno colon here")


def test_encode_answer() -> None:
    raw = simnode.encode_answer(201, {"a": 1})
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 201 Created") and b"content-length: 7" in head and body == b'{"a":1}'
    assert simnode.encode_answer(204, None).endswith(b"content-length: 0\r\n\r\n")
    assert b"connection: close" in simnode.encode_answer(400, {}, keep_alive=False)


def test_latency_warm_set_and_refusal() -> None:
    rng = random.Random(1)
    cfg = SimConfig(templates=10, warm_per_node=3)
    assert all(15.0 <= simnode.sample_ms(rng, cfg.create_ms) <= 40.0 for _ in range(100))
    warm = simnode.warm_set(rng, cfg)
    assert len(warm) == 3 and warm <= set(simnode.templates(10))
    status, body = simnode.capacity_refusal("n1", 5, 5)
    assert status == 429 and body["reason"] == "capacity"  # what the gateway tries another node on
    status, body = simnode.not_found("s1")
    assert status == 404 and "reason" not in body  # a plain unknown id, relayed as the gateway's own


def test_overdue() -> None:
    beats = [("a", 10.0), ("b", 8.4), ("c", 8.6)]
    assert simnode.overdue(beats, now=10.0, period=0.5, failures=3) == ["b"]


class _NoRedis:
    def register_script(self, script: str) -> object:
        return lambda **kw: 1


def test_node_routes_capacity_and_warm_handout(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = SimConfig(create_ms=(0.0, 0.0), warm_ms=(0.0, 0.0), call_ms=(0.0, 0.0), templates=4, warm_per_node=1,
                    pool_size=1, refill_s=60)  # fmt: skip
    node = SimNode("n1", 1, cfg, _NoRedis(), random.Random(0), capacity=2)  # type: ignore[arg-type]
    warm = next(iter(node.warm))

    class Dir:
        incarnation = 1

        def bind(self, sid: str) -> None: ...
        def unbind(self, sid: str) -> None: ...

    node.directory = Dir()  # type: ignore[assignment]

    async def run() -> list[tuple[int, object]]:
        node.alive = True
        out = []
        for t in (warm, warm, "other"):
            out.append(await node.handle("POST", "/v2/sandboxes", "", {}, json.dumps({"templateID": t}).encode()))
        sid = out[0][1]["sandboxID"]  # type: ignore[index]
        out.append(await node.handle("GET", f"/sandboxes/{sid}", "", {}, b""))
        out.append(await node.handle("DELETE", f"/sandboxes/{sid}", "", {}, b""))
        out.append(await node.handle("GET", f"/sandboxes/{sid}", "", {}, b""))
        out.append(await node.handle("GET", "/aenv/info", "", {}, b""))
        return out

    got = asyncio.run(run())
    assert [s for s, _ in got[:3]] == [201, 201, 429]  # capacity 2
    assert node.handouts == 1 and node.warm_set_hits == 2 and node.refused == 1
    assert [s for s, _ in got[3:6]] == [200, 204, 404]
    info = got[6][1]
    assert info["sandboxes"] == {"running": 1} and info["warm"] == {}  # type: ignore[index]  # pool used, refill later

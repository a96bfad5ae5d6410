"""The simulated node's pure parts: HTTP heads in and out, latencies, warm sets, the capacity refusal the
gateway retries on, the controller's death rule, and a node's routes without a listener."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from aenv.api import sse
from aenv.testing import simnode, simnode_reads
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


def _console_node() -> SimNode:
    cfg = SimConfig(create_ms=(0.0, 0.0), warm_ms=(0.0, 0.0), call_ms=(0.0, 0.0), templates=2, warm_per_node=0)
    node = SimNode("n1", 1, cfg, _NoRedis(), random.Random(0), capacity=100)  # type: ignore[arg-type]

    class Dir:
        incarnation = 1

        def bind(self, sid: str) -> None: ...
        def unbind(self, sid: str) -> None: ...

    node.directory = Dir()  # type: ignore[assignment]
    node.alive = True
    return node


def test_node_list_pages_newest_first_with_filters_and_next_token() -> None:
    """``GET /v2/sandboxes`` as the real node pages it: newest first, ``limit`` then ``X-Next-Token`` = the
    last ID given, the state and metadata filters; the legacy list is the running ones, all at once."""
    node = _console_node()

    async def run() -> dict[str, object]:
        ids = []
        for i in range(5):
            body = {"templateID": "base", "metadata": {"run": "a" if i % 2 == 0 else "b"}, "timeout": 60}
            ids.append((await node.handle("POST", "/v2/sandboxes", "", {}, json.dumps(body).encode()))[1]["sandboxID"])
        await node.handle("POST", f"/sandboxes/{ids[1]}/pause", "", {}, b"")
        first = await node.handle("GET", "/v2/sandboxes", "limit=2", {}, b"")
        token = first[1].headers["X-Next-Token"]  # type: ignore[union-attr]
        second = await node.handle("GET", "/v2/sandboxes", f"limit=2&nextToken={token}", {}, b"")
        third = await node.handle("GET", "/v2/sandboxes", f"limit=2&nextToken={second[1].headers['X-Next-Token']}",  # type: ignore[union-attr]
                                  {}, b"")  # fmt: skip
        return {"ids": ids, "pages": [first[1], second[1], third[1]],
                "paused": await node.handle("GET", "/v2/sandboxes", "state=paused", {}, b""),
                "run_a": await node.handle("GET", "/v2/sandboxes", "metadata=run%3Da&order=asc", {}, b""),
                "legacy": await node.handle("GET", "/sandboxes", "", {}, b""),
                "bad": await node.handle("GET", "/v2/sandboxes", "state=gone", {}, b""),
                "big": await node.handle("GET", "/v2/sandboxes", "limit=101", {}, b"")}

    got = asyncio.run(run())
    ids: list[str] = got["ids"]  # type: ignore[assignment]
    pages: list[simnode.Headed] = got["pages"]  # type: ignore[assignment]
    assert [[s["sandboxID"] for s in p.body] for p in pages] == [ids[4:2:-1], ids[2:0:-1], ids[0:1]]
    assert "X-Next-Token" not in pages[2].headers  # the last page says so
    assert pages[0].body[0]["metadata"] == {"run": "a"} and pages[0].body[0]["endAt"] > pages[0].body[0]["startedAt"]
    paused = got["paused"][1].body  # type: ignore[index]
    assert [s["sandboxID"] for s in paused] == [ids[1]] and paused[0]["state"] == "paused"
    assert [s["sandboxID"] for s in got["run_a"][1].body] == [ids[0], ids[2], ids[4]]  # type: ignore[index]
    assert len(got["legacy"][1]) == 4  # type: ignore[index,arg-type]  # running only
    assert got["bad"][0] == 400 and got["big"][0] == 400  # type: ignore[index]
    head = simnode.encode_answer(200, pages[0]).partition(b"\r\n\r\n")[0]
    assert f"X-Next-Token: {ids[3]}".encode() in head


def test_node_summary_metrics_and_kill_by_metadata() -> None:
    node = _console_node()

    ids: list[str] = []

    async def run() -> list[tuple[int, object]]:
        for run_id in ("a", "a", "b"):
            await node.handle("POST", "/sandboxes", "", {}, json.dumps({"metadata": {"run": run_id}}).encode())
        ids.extend(node.sandboxes)
        await node.handle("POST", f"/sandboxes/{ids[0]}/pause", "", {}, b"")
        return [
            await node.handle("GET", "/aenv/sandboxes/summary", "", {}, b""),
            await node.handle("GET", "/aenv/sandboxes/summary", "metadata=run%3Da", {}, b""),
            await node.handle("GET", "/sandboxes/metrics", f"sandbox_ids={ids[1]},nope", {}, b""),
            await node.handle("GET", "/sandboxes/metrics", "sandbox_ids=", {}, b""),
            await node.handle("DELETE", "/aenv/sandboxes", "", {}, b""),  # an empty filter: refused
            await node.handle("POST", "/aenv/sandboxes/kill", "", {}, json.dumps({"metadata": {"run": "a"}}).encode()),
            await node.handle("GET", "/aenv/sandboxes/summary", "", {}, b""),
        ]

    whole, run_a, metrics, no_ids, refused, killed, after = asyncio.run(run())
    assert whole[1] == {"total": 3, "byState": {"paused": 1, "running": 2}, "byTemplate": {"base": 3}, "runKey": "run",
                        "byRun": {"a": {"paused": 1, "running": 1}, "b": {"running": 1}}}  # fmt: skip
    assert run_a[1]["total"] == 2  # type: ignore[index]
    sample = metrics[1]["sandboxes"]  # type: ignore[index]
    assert list(sample) == [ids[1]] and sample[ids[1]]["memTotal"] == 512 << 20  # the unknown ID left out
    assert no_ids[0] == 400 and refused[0] == 400
    assert killed[0] == 200 and len(killed[1]["killed"]) == 2  # type: ignore[index]
    assert after[1]["total"] == 1  # type: ignore[index]


def test_node_events_created_paused_resumed_killed_and_resync() -> None:
    """The lifecycle frames a real node writes, each with the list item's fields; a reader that falls
    ``QUEUE`` behind is told to reload; a node's death ends its streams."""
    node = _console_node()

    async def run() -> tuple[list[bytes], list[bytes], int]:
        status, stream = await node.handle("GET", "/aenv/events", "", {}, b"")
        assert status == 200 and isinstance(stream, simnode.Stream)
        it = stream.chunks.__aiter__()
        out = [await anext(it)]  # retry: first (the reader registered by then)
        sid = (await node.handle("POST", "/sandboxes", "", {}, b'{"metadata": {"run": "r"}}'))[1]["sandboxID"]  # type: ignore[index]
        await node.handle("POST", f"/sandboxes/{sid}/pause", "", {}, b"")
        resumed = await node.handle("POST", f"/sandboxes/{sid}/connect", "", {}, b"")
        await node.handle("DELETE", f"/sandboxes/{sid}", "", {}, b"")
        out += [await anext(it) for _ in range(4)]
        slow = node.events.stream().__aiter__()
        await anext(slow)
        for _ in range(simnode_reads.QUEUE + 1):
            node.events.emit("created", next(iter(node.sandboxes.values()), simnode_reads.SimSandbox("x", "t", 0, "")), "n1")
        behind = [await anext(slow), await anext(it)]  # both fell behind: told to reload
        await node.kill()
        with pytest.raises(StopAsyncIteration):
            await anext(it)
        return out, behind, resumed[0]

    out, behind, resumed = asyncio.run(run())
    assert out[0] == sse.RETRY and resumed == 201
    events = [json.loads(chunk.split(b"data: ", 1)[1]) for chunk in out[1:]]
    assert all(chunk.startswith(b"event: lifecycle\n") for chunk in out[1:])
    assert [(e["event"], e["state"]) for e in events] == [("created", "running"), ("paused", "paused"),
                                                          ("resumed", "running"), ("killed", "killed")]  # fmt: skip
    assert events[0]["metadata"] == {"run": "r"}
    assert set(events[0]) == {"event", "sandboxID", "templateID", "alias", "state", "metadata", "startedAt", "endAt",
                              "cpuCount", "memoryMB", "at"}  # a real node's item (api/routes_console.py)
    assert behind == [sse.RESYNC, sse.RESYNC]


def test_stream_answer_over_a_socket_until_the_client_goes() -> None:
    """A streamed answer is chunked HTTP/1.1 that httpx reads line by line; the client closing ends the
    node's side (its reader deregistered)."""
    import httpx

    events = simnode_reads.SimEvents()

    async def handle(method: str, path: str, query: str, headers: dict[str, str], body: bytes) -> object:
        return 200, simnode.Stream(events.stream(keepalive_s=0.05))

    async def run() -> tuple[list[str], int]:
        server = await asyncio.start_server(lambda r, w: simnode.serve_http(r, w, handle), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        lines: list[str] = []
        async with httpx.AsyncClient(trust_env=False) as client, \
                client.stream("GET", f"http://127.0.0.1:{port}/aenv/events") as resp:  # fmt: skip
            assert resp.headers["content-type"] == "text/event-stream"
            async for line in resp.aiter_lines():
                lines.append(line)
                if line.startswith(": keepalive"):
                    events.emit("created", simnode_reads.SimSandbox("s1", "t", 0, ""), "n1")
                if line.startswith("data:"):
                    break
        for _ in range(100):
            if not events.readers:
                break
            await asyncio.sleep(0.01)
        server.close()
        return lines, len(events.readers)

    lines, readers = asyncio.run(run())
    assert lines[0] == "retry: 2000" and "event: lifecycle" in lines
    assert json.loads(lines[-1][5:])["sandboxID"] == "s1"
    assert readers == 0

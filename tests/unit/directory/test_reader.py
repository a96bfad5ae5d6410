"""The gateway's reads of the node records: every record, in two round trips whatever the node count."""

from __future__ import annotations

import asyncio

import redis

from aenv.directory import keys
from aenv.directory.node import NodeDirectory, mark_dead
from aenv.directory.reader import DirectoryReader


def test_nodes_reads_every_record_pipelined(client: redis.Redis, redis_url: str) -> None:
    for i in range(300):
        NodeDirectory(client, f"n{i:03d}", f"http://127.0.0.1:{20000 + i}").register()
    mark_dead(client, "n007", "test")
    client.sadd(keys.NODES, "ghost")  # listed, no record: skipped

    async def read() -> tuple[list, int]:  # type: ignore[type-arg]
        reader = DirectoryReader(redis_url)
        sent = 0
        real = reader.client.execute_command

        async def counting(*args: object, **kw: object) -> object:
            nonlocal sent
            sent += 1
            return await real(*args, **kw)

        reader.client.execute_command = counting  # type: ignore[method-assign]
        try:
            return await reader.nodes(), sent
        finally:
            await reader.aclose()

    got, sent = asyncio.run(read())
    assert [r.id for r in got] == [f"n{i:03d}" for i in range(300)]
    assert got[7].status == "dead" and got[7].incarnation == 2 and got[8].status == "alive"
    assert got[42].url == "http://127.0.0.1:20042"
    assert sent == 1  # SMEMBERS alone goes through execute_command; the 300 HGETALLs are one pipeline

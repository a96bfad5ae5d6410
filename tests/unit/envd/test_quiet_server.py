"""envd's uvicorn server wakes once a second when idle (uvicorn's own: ten times), does uvicorn's
per-second work on every tick, and still stops when told."""

from __future__ import annotations

import asyncio
import time

import pytest
import uvicorn

from aenv.envd import __main__ as envd_main


async def _app(scope: object, receive: object, send: object) -> None:  # never called: no request is made
    raise AssertionError


def test_the_idle_loop_ticks_once_a_second_and_stops_when_told(monkeypatch: pytest.MonkeyPatch) -> None:
    assert envd_main.TICK_S >= 1.0
    monkeypatch.setattr(envd_main, "TICK_S", 0.02)
    server = envd_main.quiet_server(uvicorn.Config(_app, lifespan="off", log_level="warning"))
    assert isinstance(server, uvicorn.Server)
    ticks: list[tuple[float, int]] = []

    async def on_tick(counter: int) -> bool:
        ticks.append((time.monotonic(), counter))
        if len(ticks) == 4:
            server.should_exit = True
        return server.should_exit

    server.on_tick = on_tick  # type: ignore[method-assign]
    asyncio.run(asyncio.wait_for(server.main_loop(), 5))
    assert len(ticks) == 4  # the loop ends on the tick that sees should_exit
    assert all(c % 10 == 0 for _, c in ticks)  # uvicorn's once-a-second work on every tick
    gaps = [b - a for (a, _), (b, _) in zip(ticks, ticks[1:], strict=False)]
    assert min(gaps) >= 0.015

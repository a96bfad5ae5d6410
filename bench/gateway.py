"""What the gateway's hop costs: the same calls straight to a node and through ``aenv gateway`` in front
of it, sampled alternately in one run. ``commands.run("true")`` in a running sandbox (back to back, blocks
of 10 alternating) and create → first command (serial, each a warm-pool hand-out). One node is enough: the extra hop is the same
whatever the number of nodes; creates/s over several nodes on one machine would measure the shared CPU,
not the routing."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aenv.testing.gateway import start_gateway, stop_gateway
from bench.context import Ctx
from bench.rows import alternate, ms_since, row, scenario, timed

TEMPLATE = "base"
# After each create: time for the node's warm pool to refill (a refill is ~0.1-0.2 s here). Without it a
# create now and then finds the pool empty and cold-starts (~230 ms), and with 20 samples those decide
# the medians' difference more than the gateway's hop does.
REFILL_S = 0.5


def _sandbox(url: str) -> Any:
    from e2b import Sandbox

    return Sandbox.create(TEMPLATE, timeout=600, api_url=url, sandbox_url=url)


def gateway_overhead(ctx: Ctx) -> dict[str, Any]:
    """commands.run and create → first command through ``aenv gateway`` vs straight to the node."""
    with tempfile.TemporaryDirectory(prefix="aenv-bench-gateway-") as tmp:
        gw = start_gateway(Path(tmp), [ctx.url])
        try:
            return _measure(ctx, gw.url)
        finally:
            stop_gateway(gw)


def _measure(ctx: Ctx, gateway_url: str) -> dict[str, Any]:
    via = f"{ctx.system} via gateway"
    direct, routed = _sandbox(ctx.url), _sandbox(gateway_url)
    try:
        direct.commands.run("true")
        routed.commands.run("true")

        def burst(sbx: Any) -> Callable[[], list[float]]:
            return lambda: [timed(lambda: sbx.commands.run("true")) for _ in range(10)]

        bursts = alternate(ctx.n(1, 10), [(ctx.system, burst(direct)), (via, burst(routed))])
    finally:
        direct.kill()
        routed.kill()

    def create_on(url: str) -> Callable[[], float]:
        def once() -> float:
            t0 = time.perf_counter()
            sbx = _sandbox(url)
            sbx.commands.run("true")
            took = ms_since(t0)
            sbx.kill()
            time.sleep(REFILL_S)  # untimed: the node's warm pool refills, so each create is a hand-out
            return took

        return once

    creates = alternate(ctx.n(3, 40), [(ctx.system, create_on(ctx.url)), (via, create_on(gateway_url))])
    rows = [row("commands.run(true) back to back", name, [x for b in blocks for x in b]) for name, blocks in bursts.items()]
    rows += [row("create → first command", name, samples) for name, samples in creates.items()]
    return scenario("through the gateway vs straight to the node", rows,
                    ["the gateway runs on the same machine, in front of this one node"])  # fmt: skip

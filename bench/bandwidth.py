"""Bandwidth limits: the throughput of a sandbox created with aenv's ``bandwidth`` option beside an
unlimited one on the same server, both to the project's throughput host (a network namespace on a veth
pair, ``tests/fixtures/throughput.py``: a sink and a source reached through slirp4netns like any public
address). Egress is the sandbox uploading to the sink, ingress downloading from the source; each rate
is what the receiving side saw from its first byte to its last (connection set-up not counted, the
token bucket's first 128 KiB burst counted). Samples alternate between the two sandboxes. The
``measured / set`` rows are the issue's "within 10%" figure; the unlimited rows show the limit is what
holds the rate, not the path. Run by name (``--scenarios bandwidth``): it needs root (it makes the
host's namespace)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import httpx

from aenv.testing.server import API_KEY
from bench.context import Ctx
from bench.rows import alternate, row, scenario

EGRESS_MBIT, INGRESS_MBIT = 20.0, 40.0


def _create(ctx: Ctx, limits: dict[str, float]) -> Any:
    from e2b import Sandbox

    answer = httpx.post(f"{ctx.url}/sandboxes", json={"templateID": "base", "timeout": 900, "bandwidth": limits},
                        headers={"X-API-KEY": API_KEY}, trust_env=False, timeout=300)
    answer.raise_for_status()
    return Sandbox.connect(answer.json()["sandboxID"])


def bandwidth(ctx: Ctx) -> dict[str, Any]:
    title = "bandwidth limits: a limited sandbox beside an unlimited one"
    if os.geteuid() != 0:
        return scenario(title, [], ["skipped: the throughput host needs root"])
    from tests.fixtures.throughput import measure, throughput_host

    seconds = 1.5 if ctx.smoke else 3.0
    free_bytes = (16 if ctx.smoke else 48) * 2**20
    system = f"aenv-{ctx.runtime}"
    with throughput_host() as host:
        limited = _create(ctx, {"egressMbit": EGRESS_MBIT, "ingressMbit": INGRESS_MBIT})
        free = _create(ctx, {"egressMbit": 0, "ingressMbit": 0})
        try:
            def sample(sbx: Any, direction: str, mbit: float | None) -> Callable[[], float]:
                nbytes = int(mbit * 1e6 / 8 * seconds) if mbit else free_bytes
                return lambda: measure(sbx, host, direction, nbytes, timeout=600)

            n = ctx.n(2, 5)
            up = alternate(n, [("limited", sample(limited, "up", EGRESS_MBIT)), ("free", sample(free, "up", None))])
            down = alternate(n, [("limited", sample(limited, "down", INGRESS_MBIT)),
                                 ("free", sample(free, "down", None))])
        finally:
            limited.kill()
            free.kill()
    rows = []
    for name, samples, limit in (("egress", up, EGRESS_MBIT), ("ingress", down, INGRESS_MBIT)):
        rows += [
            row(f"{name}, limit {limit:.0f} Mbit/s", system, samples["limited"], unit="Mbit/s"),
            row(f"{name}, limited: measured / set", system, [v / limit * 100 for v in samples["limited"]], unit="%"),
            row(f"{name}, unlimited (beside it)", system, samples["free"], unit="Mbit/s"),
        ]
    return scenario(title, rows, [
        f"{seconds:.1f} s a limited transfer, {free_bytes >> 20} MiB an unlimited one; tc tbf on the sandbox's "
        "tap (egress) and on an ifb its tap's ingress is redirected to (ingress), runtime/shaping.py",
    ])

"""What an E2B volume mount costs: create → first command with a volume mounted beside the same create
without one, and ``fork(count=1)`` of a sandbox with a volume beside one without (both on the server
under test, samples alternating in the same run), and ``docker run -v`` beside ``docker run`` as the
container baseline. On vm a sandbox with volumes starts in a QEMU of its own, after its binds (no warm
pool), and a fork first asks the guest what holds its volumes (``runtime/vm/volumes.py``).
"""

from __future__ import annotations

import secrets
import tempfile
import time
from collections.abc import Callable
from typing import Any

from bench.context import Ctx
from bench.rows import alternate, ms_since, row, scenario, timed

TEMPLATE = "base"


def volume_mounts(ctx: Ctx) -> dict[str, Any]:
    from e2b import Sandbox, Volume

    vol = Volume.create(f"bench-{secrets.token_hex(4)}")

    def mounts(with_volume: bool) -> dict[str, Any] | None:
        return {"/data": vol} if with_volume else None

    def create(with_volume: bool) -> Callable[[], float]:
        def once() -> float:
            t0 = time.perf_counter()
            sbx = Sandbox.create(TEMPLATE, timeout=600, volume_mounts=mounts(with_volume))
            sbx.commands.run("true")
            took = ms_since(t0)
            sbx.kill()
            return took

        return once

    def fork(with_volume: bool) -> Callable[[], float]:
        def once() -> float:
            sbx = Sandbox.create(TEMPLATE, timeout=600, volume_mounts=mounts(with_volume))
            kids: list[Any] = []
            try:
                took = timed(lambda: kids.extend(sbx.fork(count=1)))
                failed = [k for k in kids if isinstance(k, Exception)]
                if failed:
                    raise RuntimeError(f"fork failed: {failed[0]}")
                return took
            finally:
                for k in (*kids, sbx):
                    if not isinstance(k, Exception):
                        k.kill()

        return once

    n = ctx.n(2, 10, vm=5)
    with_vol, without = f"{ctx.system} + volume", ctx.system
    try:
        systems = [(with_vol, create(True)), (without, create(False))]
        with tempfile.TemporaryDirectory(prefix="aenv-bench-vol-") as d:
            if ctx.docker is not None:
                docker = ctx.docker

                def docker_run(*extra: str) -> Callable[[], float]:
                    return lambda: timed(lambda: docker.docker("run", "--rm", "--network", "none", *extra,
                                                               docker.image, "/bin/true"))

                systems += [("docker -v", docker_run("-v", f"{d}:/data")), ("docker", docker_run())]
            created = alternate(n, systems)
        forked = alternate(n, [(with_vol, fork(True)), (without, fork(False))])
    finally:
        Volume.destroy(vol.volume_id)
    # Each metric pairs aenv with the baseline doing the same job (the table's ratio column reads so).
    rows = [row("create → first command, a volume mounted", ctx.system, created[with_vol]),
            row("create → first command, no volume", ctx.system, created[without])]
    if "docker -v" in created:
        rows += [row("create → first command, a volume mounted", "docker", created["docker -v"],
                     note="`docker run --rm --network none -v DIR:/data IMAGE /bin/true`"),
                 row("create → first command, no volume", "docker", created["docker"],
                     note="`docker run --rm --network none IMAGE /bin/true`")]
    rows += [row("fork ×1 (the call), a volume mounted", ctx.system, forked[with_vol]),
             row("fork ×1 (the call), a volume mounted", "same fork, no volume", forked[without],
                 note="the same fork of a sandbox without a volume: what the mount adds")]
    return scenario("E2B volume mounts", rows)

"""Template builds: ``Template.build`` of a small template (a COPY and three RUN steps on ``base``), cold
and rebuilt with only its last step changed, against ``docker build`` of the same Dockerfile on the same
base rootfs (``--no-cache``, then with docker's layer cache). Samples alternate between the systems."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.context import Ctx
from bench.rows import alternate, ms_since, row, scenario

STEPS = ["mkdir -p /opt/app && cp -r /opt/src/. /opt/app/", "sha256sum /opt/app/* > /opt/sums",
         "python3 -c 'print(sum(range(10**6)))' > /opt/answer"]


def _context() -> Path:
    ctx = Path(tempfile.mkdtemp(prefix="aenv-bench-build-"))
    (ctx / "src").mkdir()
    for i in range(20):
        (ctx / "src" / f"f{i}.txt").write_bytes(os.urandom(4096))
    return ctx


def template_build(ctx: Ctx) -> dict[str, Any]:
    """Template.build cold and with only the last step changed, vs docker build."""
    from e2b import Template

    context = _context()
    name = f"bench-build-{secrets.token_hex(3)}"
    rounds = ctx.n(1, 5, vm=3)

    def ours(last: Callable[[], str], skip_cache: bool) -> Callable[[], float]:
        def once() -> float:
            t = Template(file_context_path=str(context)).from_template("base").copy("src", "/opt/src/")
            for cmd in STEPS:
                t = t.run_cmd(cmd, user="root")
            t = t.run_cmd(f"echo {last()} > /opt/last", user="root")
            t0 = time.perf_counter()
            Template.build(t, name, skip_cache=skip_cache)
            return ms_since(t0)

        return once

    def theirs(last: Callable[[], str], no_cache: bool) -> Callable[[], float]:
        assert ctx.docker is not None
        docker = ctx.docker

        def once() -> float:
            lines = [f"FROM {docker.image}", "COPY src /opt/src/"] + [f"RUN {c}" for c in STEPS]
            lines.append(f"RUN echo {last()} > /opt/last")
            (context / "Dockerfile").write_text("\n".join(lines) + "\n")
            t0 = time.perf_counter()
            subprocess.run(["docker", "build", "--network", "none", *(["--no-cache"] if no_cache else []),
                            "-t", f"{name}:latest", str(context)],
                           env={**docker.env, "DOCKER_BUILDKIT": "0"}, check=True, capture_output=True)
            return ms_since(t0)

        return once

    counter = iter(range(1_000_000))

    def fresh() -> str:
        return f"round-{next(counter)}"

    cold: list[tuple[str, Callable[[], float]]] = [(ctx.system, ours(fresh, True))]
    warm: list[tuple[str, Callable[[], float]]] = [(ctx.system, ours(fresh, False))]
    docker = ctx.heavy_docker()
    if docker is not None:
        cold.append(("docker build", theirs(fresh, True)))
        warm.append(("docker build", theirs(fresh, False)))
    try:
        first = alternate(rounds, cold)
        again = alternate(rounds, warm)
    finally:
        shutil.rmtree(context, ignore_errors=True)
    notes = {"docker build": "`docker build` (legacy builder) of the same Dockerfile on the same base rootfs"}
    rows = [row("template build, cold", k, v, note=notes.get(k, "a COPY and 4 RUN steps on base, skip_cache"))
            for k, v in first.items()]
    rows += [row("template build, last step changed", k, v,
                 note=notes.get(k, "the first 4 steps from the cache")) for k, v in again.items()]
    return scenario("template build: cold and with only the last step changed", rows)

"""Scenario ``compose``: a two-service Compose project in a sandbox (issue 40) beside the host's own Docker.

The project is the counter app + redis of ``tests/fixtures/compose_images.py`` (the app keeps a counter in
redis by service name; both with healthchecks, the app ``depends_on`` redis healthy). The scenario brings
its own registry with the two images and a server of the bench's runtime whose ``docker.io`` mirror it is
(the ``docker`` template must be built: ``aenv template build docker``). Rows:

* ``compose up → services healthy``: ``POST /sandboxes-compose`` until it answers, which it does only once
  ``docker compose up --wait`` succeeded in the sandbox (images from the node's cache, ``docker load``\\ ed
  into a fresh dockerd every time; the first create, which fetches them from the registry, is a row of its
  own); beside it ``docker compose up -d --wait`` of the same project on the bench's private dockerd
  (images already in the engine; the app's port published on an ephemeral loopback port instead of 8080,
  the host's own);
* ``fork ×4 → both services answer in every child``: ``POST /fork`` of the running compose sandbox until
  ``/cgi-bin/hit`` (app → redis) answers in each child, and each child's count follows the parent's (the
  services' state came along); beside it, for scale only, four more projects ``up --wait`` on the host in
  parallel (fresh: Docker has no fork). On ns the fork answers 409 (CRIU cannot dump Docker inside): the
  notes say so and there are no aenv fork rows (the host's are taken all the same: the bench starts its
  baselines for the first runtime only, so ``--runtime ns,vm`` puts them beside ns' rows).

``--smoke`` takes one sample of each. Nothing asserts on numbers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from aenv.images.registry import RegistryClient
from aenv.testing.server import API_KEY, Server, start_server, stop_server
from bench.baselines import DockerBaseline
from bench.context import Ctx
from bench.rows import Row, ms_since, row, scenario
from tests.fixtures.compose_images import APP_IMAGE, APP_PORT, COMPOSE_YAML, REDIS_IMAGE, push_compose_images
from tests.fixtures.registry import start_registry

FORKS = 4
HIT = f"curl -fsS http://127.0.0.1:{APP_PORT}/cgi-bin/hit"
TITLE = "compose project (app + redis) in a sandbox"


def compose_sandboxes(ctx: Ctx) -> dict[str, Any]:
    """Compose: POST /sandboxes-compose → healthy, fork ×4 of it vs `docker compose up --wait` on the host"""
    plugin = compose_plugin()
    if plugin is None:
        return scenario(TITLE, [], ["skipped: the docker template is not built (aenv template build docker)"])
    n_up, n_fork = ctx.n(1, 5, vm=3), ctx.n(1, 3, vm=2)
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="aenv-bench-compose-") as t, contextlib.ExitStack() as stack:
        tmp = Path(t)
        reg = start_registry(tmp / "registry")
        stack.callback(reg.stop)
        asyncio.run(_push(reg.url))
        srv = stack.enter_context(_server(tmp / "server", ctx.runtime, reg.url))
        host = None
        if ctx.docker is not None:
            host = HostCompose(ctx.docker, plugin, reg.host, tmp / "host")
            stack.callback(host.close)
        _boot_template(srv)  # vm: the template's first boot and snapshot (minutes under TCG), not a sample
        cold = [_up_checked(srv)]  # the node fetches the images from the registry (then cached)
        ours: list[float] = []
        theirs: list[float] = []
        for i in range(n_up):
            for who in (["aenv", "docker"] if i % 2 == 0 else ["docker", "aenv"]):
                if who == "aenv":
                    ours.append(_up_checked(srv))
                elif host is not None:
                    theirs.append(host.up_once())
        forks, fork_calls, host_many = _forks(ctx, srv, host, n_fork, notes)
    rows: list[Row] = [
        row("compose up → services healthy", ctx.system, ours,
            note="POST /sandboxes-compose: images from the node's cache, docker load, up --wait"),
        row("compose up → services healthy, images not yet on the node", ctx.system, cold,
            note="the first: the node fetches both images from the registry (localhost) first"),
    ]
    if theirs:
        rows.append(row("compose up → services healthy", "docker", theirs,
                        note="docker compose up -d --wait, images already in the engine"))
    if forks:
        rows.append(row(f"compose fork ×{FORKS} → both services answer in every child", ctx.system, forks))
        rows.append(row(f"compose fork ×{FORKS}: the fork call", ctx.system, fork_calls))
    if host_many:
        rows.append(row(f"compose fork ×{FORKS} → both services answer in every child", "docker", host_many,
                        note=f"{FORKS} fresh projects up --wait in parallel (no fork: no state carried)"))
    return scenario(TITLE, rows, notes)


def _forks(ctx: Ctx, srv: Server, host: HostCompose | None, n: int,
           notes: list[str]) -> tuple[list[float], list[float], list[float]]:  # fmt: skip
    """Fork ×4 of one running compose sandbox, ``n`` times (and the host's 4 fresh projects in between)."""
    from aenv.client import AenvClient, ApiError

    walls: list[float] = []
    calls: list[float] = []
    host_many: list[float] = []
    parent = compose_up(srv)
    try:
        with AenvClient(srv.url, API_KEY) as client:
            for i in range(n):
                if host is not None and not ctx.smoke and i % 2 == 1:
                    host_many.append(host.up_many(FORKS))
                before = int(_run(srv, parent, HIT))
                t0 = time.perf_counter()
                try:
                    res = client.fork(parent, FORKS)
                except ApiError as exc:  # a runtime that cannot fork this sandbox says why (409)
                    notes.append(f"fork of a compose sandbox refused on {ctx.runtime}: {exc}")
                    break
                calls.append(ms_since(t0))
                try:
                    if res.errors:
                        raise RuntimeError(f"fork ×{FORKS}: {res.errors[0]}")
                    with concurrent.futures.ThreadPoolExecutor(FORKS) as pool:
                        counts = list(pool.map(lambda sid: _hit_until_up(srv, sid), res.sandbox_ids))
                    walls.append(ms_since(t0))
                finally:
                    for sid in res.sandbox_ids:
                        _kill(srv, sid)
                if i == 0:
                    notes.append(f"fork: the parent's count was {before}, each child's first hit answered "
                                 f"{sorted(set(counts))} (redis' state came along: {before} + 1 expected)")
                if host is not None and not ctx.smoke and i % 2 == 0:
                    host_many.append(host.up_many(FORKS))
    finally:
        _kill(srv, parent)
    while host is not None and not ctx.smoke and len(host_many) < n:  # the fork refused (ns): still the host's
        host_many.append(host.up_many(FORKS))
    return walls, calls, host_many


# -- aenv ------------------------------------------------------------------------------------------------


def compose_up(srv: Server, yaml_text: str = COMPOSE_YAML) -> str:
    """``POST /sandboxes-compose``; the sandbox's ID once every service is up and healthy."""
    resp = httpx.post(f"{srv.url}/sandboxes-compose", headers={"X-API-Key": API_KEY}, timeout=900,
                      json={"compose": yaml_text, "timeout": 900, "startupTimeout": 900})  # fmt: skip
    if resp.status_code >= 400:
        raise RuntimeError(f"POST /sandboxes-compose: {resp.status_code} {resp.text[-2000:]}")
    return str(resp.json()["sandboxID"])


def _boot_template(srv: Server) -> None:
    """One plain ``docker`` sandbox, killed: what a node does once per template (a vm boots and snapshots
    it; ns has nothing to do), so the samples measure compose sandboxes, not that."""
    from e2b import Sandbox

    sbx = Sandbox.create("docker", timeout=900, request_timeout=900, api_url=srv.url, sandbox_url=srv.url,
                         api_key=API_KEY)  # fmt: skip
    sbx.kill()


def _up_checked(srv: Server) -> float:
    """One compose sandbox up (timed), checked (not timed), killed; milliseconds."""
    t0 = time.perf_counter()
    sid = compose_up(srv)
    took = ms_since(t0)
    try:
        _check(srv, sid)
    finally:
        _kill(srv, sid)
    return took


def _run(srv: Server, sandbox_id: str, cmd: str) -> str:
    from e2b import Sandbox

    sbx = Sandbox.connect(sandbox_id, api_url=srv.url, sandbox_url=srv.url, api_key=API_KEY)
    return sbx.commands.run(cmd, user="root", timeout=60).stdout.strip()


def _check(srv: Server, sandbox_id: str) -> None:
    """Both services answer: the app's hit goes through redis (a number back, not an error)."""
    answer = _run(srv, sandbox_id, HIT)
    if not answer.isdigit():
        raise RuntimeError(f"compose sandbox {sandbox_id}: /cgi-bin/hit answered {answer!r}")


def _hit_until_up(srv: Server, sandbox_id: str, deadline_s: float = 120.0) -> int:
    """A forked child's first successful hit (its services may still be coming back): the count."""
    from e2b import CommandExitException

    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return int(_run(srv, sandbox_id, HIT))
        except (CommandExitException, ValueError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _kill(srv: Server, sandbox_id: str) -> None:
    with contextlib.suppress(httpx.HTTPError):
        httpx.delete(f"{srv.url}/sandboxes/{sandbox_id}", headers={"X-API-Key": API_KEY}, timeout=60)


async def _push(registry_url: str) -> None:
    async with RegistryClient(mirrors={"docker.io": registry_url}) as client:
        await push_compose_images(client)


@contextlib.contextmanager
def _server(tmp: Path, runtime: str, registry_url: str) -> Iterator[Server]:
    tmp.mkdir(parents=True, exist_ok=True)
    srv = start_server(tmp, runtime, {"AENV_REGISTRY_MIRRORS": f"docker.io={registry_url}", "AENV_POOL_SIZE": "0"})
    try:
        yield srv
    finally:
        stop_server(srv)


def compose_plugin() -> Path | None:
    """Compose v2 from the docker template's layers (the host's Docker has no Compose plugin)."""
    from aenv.config import load_settings

    try:
        from aenv.images.docker_template import PLUGIN_DIR, docker_layers_if_built
    except ImportError:  # a checkout without the docker template
        return None
    layers = docker_layers_if_built(load_settings())
    plugin = layers.compose / PLUGIN_DIR / "docker-compose" if layers is not None else None
    return plugin if plugin is not None and plugin.is_file() else None


# -- the host's Docker -----------------------------------------------------------------------------------


class HostCompose:
    """``docker compose`` against the bench's private dockerd: Compose v2 through ``DOCKER_CONFIG``'s
    cli-plugins, the two images pulled once from the scenario's registry and tagged as the project names
    them, and the project with its app port on an ephemeral loopback port (8080 is the host's)."""

    def __init__(self, docker: DockerBaseline, plugin: Path, registry: str, root: Path) -> None:
        self.docker = docker
        self.root = root
        (root / "config" / "cli-plugins").mkdir(parents=True)
        shutil.copy2(plugin, root / "config" / "cli-plugins" / "docker-compose")
        (root / "compose.yaml").write_text(COMPOSE_YAML.replace(f'"{APP_PORT}:{APP_PORT}"', f'"127.0.0.1::{APP_PORT}"'))
        self.env = {**docker.env, "DOCKER_CONFIG": str(root / "config"), "COMPOSE_ANSI": "never"}
        for name, path in ((REDIS_IMAGE, f"library/{REDIS_IMAGE}"), (APP_IMAGE, APP_IMAGE)):
            docker.docker("pull", f"{registry}/{path}")
            docker.docker("tag", f"{registry}/{path}", name)
        self._n = 0

    def _compose(self, project: str, *args: str) -> None:
        subprocess.run(["docker", "compose", "-p", project, "-f", str(self.root / "compose.yaml"), *args],
                       env=self.env, check=True, capture_output=True, timeout=600)  # fmt: skip

    def _hit(self, project: str) -> None:
        port = subprocess.run(["docker", "compose", "-p", project, "-f", str(self.root / "compose.yaml"), "port",
                               "app", str(APP_PORT)], env=self.env, check=True, capture_output=True,
                              text=True).stdout.strip()  # fmt: skip
        answer = httpx.get(f"http://{port}/cgi-bin/hit", timeout=10).text.strip()
        if not answer.isdigit():
            raise RuntimeError(f"host compose project {project}: /cgi-bin/hit answered {answer!r}")

    def _project(self) -> str:
        self._n += 1
        return f"aenvbench{os.getpid()}x{self._n}"

    def up_once(self) -> float:
        """``up -d --wait`` of one project (timed), checked, then ``down`` (not timed)."""
        project = self._project()
        try:
            t0 = time.perf_counter()
            self._compose(project, "up", "-d", "--wait")
            took = ms_since(t0)
            self._hit(project)
            return took
        finally:
            self._compose(project, "down", "-t", "0")

    def up_many(self, n: int) -> float:
        """``n`` projects ``up -d --wait`` in parallel until each answers (timed), then ``down``."""
        projects = [self._project() for _ in range(n)]

        def one(project: str) -> None:
            self._compose(project, "up", "-d", "--wait")
            self._hit(project)

        try:
            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(n) as pool:
                list(pool.map(one, projects))
            return ms_since(t0)
        finally:
            with concurrent.futures.ThreadPoolExecutor(n) as pool:
                list(pool.map(lambda p: self._compose(p, "down", "-t", "0"), projects))

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

"""Harbor runs a compose task on aenv (issue 40): ``environment/docker-compose.yaml`` adds a web app and
redis beside Harbor's ``main`` service, and the ``oracle`` agent counts visits through the app, which keeps
the counter in redis by service name; reward 1. Harbor loads aenv's environment by import path
(``aenv.integrations.harbor_compose``, from this checkout's ``src`` on ``PYTHONPATH``), which runs the
project in one sandbox of the ``docker`` template:

* ``route``: through aenv's ``POST /sandboxes-compose`` (images fetched by aenv's registry client from the
  session's local registry, then loaded into the sandbox's dockerd); ``route-build`` too, with ``main``
  built in the sandbox from the task's ``environment/Dockerfile``, sent as its build context, and the task
  ``no-network`` (the sandbox offline, its services still reaching each other);
* ``sdk``: ``docker compose up --wait`` inside a sandbox made through the E2B SDK, its dockerd pulling from
  that registry through the private-egress port the server opens for it (``main`` from a gzip copy of
  ``debian:bookworm``: Docker 20.10 cannot unpack the fixture's zstd layers).

Slow (Harbor's start-up, the sandbox's dockerd); per runtime: ``AENV_TEST_RUNTIME=ns|vm pytest -m slow
tests/integration/test_harbor_compose.py``."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from aenv.images.registry import RegistryClient
from aenv.testing.server import API_KEY, Server, discard_vm_state, start_server, stop_server
from tests.fixtures.compose_images import DEBIAN_GZIP_IMAGE, push_compose_images
from tests.fixtures.docker import docker_env, register_docker
from tests.fixtures.harbor import (
    COMPOSE_TASK_VERIFIER_OUT,
    compose_task_files,
    harbor_env,
    harbor_python,
    seconds,
    write_task,
)
from tests.fixtures.plugin import PushedImages

pytestmark = [pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[2]
ENVIRONMENT = "aenv.integrations.harbor_compose:AenvComposeEnvironment"


@pytest.fixture(scope="module")
def harbor() -> Path:
    return harbor_python()


@pytest.fixture(scope="module")
def compose_server(
    harbor: Path, tmp_path_factory: pytest.TempPathFactory, pushed_images: PushedImages, runtime_name: str
) -> Iterator[Server]:
    """A server with the ``docker`` template whose ``docker.io`` is the session's registry, which sandboxes
    may also reach at ``10.0.2.2:<its port>`` (private egress) for ``mode=sdk``."""
    from tests.integration.conftest import _needs_runtime

    _needs_runtime(runtime_name)
    for image in ("debian:bookworm", "redis:7", "aenv/counter-app:1"):
        pushed_images.require(image)
    asyncio.run(_push_gzip_main(pushed_images.registry.url))
    port = int(pushed_images.registry.host.rsplit(":", 1)[1])
    srv = start_server(tmp_path_factory.mktemp("compose-server"), runtime_name, {
        "AENV_REGISTRY_MIRRORS": f"docker.io={pushed_images.registry.url}", "AENV_POOL_SIZE": "0", **docker_env(port),
    })  # fmt: skip
    try:
        register_docker(srv)  # built or found in the cache; skips saying why where it cannot be built
        yield srv
    finally:
        stop_server(srv)
        discard_vm_state(srv.state_dir)


async def _push_gzip_main(registry_url: str) -> None:
    """``debian:bookworm-gzip`` for mode=sdk, whose dockerd pulls it (Docker 20.10 unpacks no zstd)."""
    async with RegistryClient(mirrors={"docker.io": registry_url}) as client:
        await push_compose_images(client, main=True)


def _running(server: Server) -> list[str]:
    resp = httpx.get(f"{server.url}/sandboxes", headers={"X-API-Key": API_KEY}, timeout=30)
    return [s["sandboxID"] for s in resp.json()]


@pytest.mark.parametrize("mode", ["route", pytest.param("sdk", marks=pytest.mark.slow),
                                  pytest.param("route-build", marks=pytest.mark.slow)])
def test_harbor_compose_task_oracle_scores_one(
    harbor: Path, compose_server: Server, pushed_images: PushedImages, runtime_name: str, mode: str,
    tmp_path: Path, record_property: pytest.RecordProperty,
) -> None:  # fmt: skip
    main = DEBIAN_GZIP_IMAGE if mode == "sdk" else "debian:bookworm"  # aenv's route loads zstd layers too
    build = mode == "route-build"  # main built from environment/Dockerfile, its context sent with the request
    # route-build also runs offline: the sandbox without internet, its services still reaching each other
    task = write_task(tmp_path / "compose-counter", compose_task_files(main, build=build, offline=build))
    jobs = tmp_path / "jobs"
    cmd = [str(harbor.parent / "harbor"), "run", "-p", str(task), "-e", ENVIRONMENT, "-a", "oracle",
           "-o", str(jobs), "--job-name", "aenv", "-k", "1", "-n", "1", "-y", "-q",
           "--ek", f"mode={mode.removesuffix('-build')}"]  # fmt: skip
    if mode == "sdk":
        cmd += ["--ek", f"registry_mirror=http://10.0.2.2:{pushed_images.registry.host.rsplit(':', 1)[1]}"]
    env = harbor_env(compose_server.url, PYTHONPATH=str(REPO / "src"))
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200, check=False)
    output = (res.stdout + res.stderr)[-4000:]
    assert res.returncode == 0, output
    job = json.loads((jobs / "aenv" / "result.json").read_text())
    assert job["n_total_trials"] == 1 and job["stats"]["n_errored_trials"] == 0, (job, output)
    [trial] = [p.parent for p in (jobs / "aenv").glob("*/result.json")]
    result = json.loads((trial / "result.json").read_text())
    assert result.get("exception_info") is None, result["exception_info"]
    assert result["verifier_result"]["rewards"] == {"reward": 1.0}, result["verifier_result"]
    origin = "dockerfile\n" if build else ""  # what main's Dockerfile left in the image
    assert (trial / "verifier" / "test-stdout.txt").read_text() == COMPOSE_TASK_VERIFIER_OUT + origin
    assert _running(compose_server) == []  # the environment's stop killed the sandbox and its services
    print(f"{runtime_name}/{mode}: trial {seconds(result):.1f} s "
          f"(environment setup {seconds(result['environment_setup']):.1f} s)")  # fmt: skip
    record_property(f"harbor_compose_{mode}_trial_seconds", seconds(result))

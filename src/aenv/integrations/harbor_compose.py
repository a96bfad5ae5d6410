"""A Harbor environment that runs a task's Compose project inside one aenv ``docker`` sandbox (issue 40).

Harbor's own ``e2b`` environment runs one image per sandbox; its Docker-in-Docker providers (Modal,
Daytona, GKE) run ``docker compose`` on a remote Docker host. This is the same idea on aenv: the sandbox
is the Docker host, the task's services run in it, and Harbor's ``main`` service is where the agent and
the verifier run. Harbor loads it by import path, in Harbor's own venv (Python >= 3.12), with aenv's
source on ``PYTHONPATH`` and nothing of aenv installed there::

    PYTHONPATH=/path/to/aenv/src E2B_API_URL=http://127.0.0.1:8000 E2B_SANDBOX_URL=http://127.0.0.1:8000 \\
    E2B_API_KEY=... harbor run -p TASK -a oracle -e aenv.integrations.harbor_compose:AenvComposeEnvironment

The project is Harbor's layers merged into one (``compose_layers.py``): ``main`` from the task's
``docker_image`` (or built from ``environment/Dockerfile``), the task's ``environment/docker-compose.yaml``,
``--extra-docker-compose`` overlays and the task's environment variables for ``main``. Two ways up
(``--ek mode=...``):

* ``route`` (default): aenv's ``POST /sandboxes-compose`` (docs/docker.md). aenv fetches every image through
  its registry client and mirrors, loads them into the sandbox's dockerd, builds ``build:`` services from
  the contexts sent with the request (``main``'s: the task's environment/) and answers once
  ``compose up --wait`` succeeded; no sandbox pulls anything, and a project that fails is torn down by aenv.
* ``sdk``: a sandbox of the ``docker`` template through the E2B SDK, then ``docker compose up --wait``
  inside, as Harbor's DinD providers do; images are pulled by the sandbox's dockerd (``registry_mirror``
  points it at a mirror the sandbox may reach, or the operator's ``package_mirrors`` ``docker`` entry does).

Then every operation is Harbor's own Compose operations (``DinDComposeOps``: ``docker compose exec`` into
a service, ``docker compose cp`` through the sandbox's filesystem) run by the E2B SDK as root in the
sandbox. No host bind mounts: Harbor's log directories are copied out, as with its ``e2b`` environment.
``network_mode = "no-network"`` makes the whole sandbox offline (the services still reach each other),
where Harbor's Docker environment would cut ``main`` off its own sidecars too.
"""

from __future__ import annotations

import asyncio
import base64
import re
import shlex
import tempfile
from pathlib import Path
from typing import Any, Literal
from uuid import uuid4

import httpx
import yaml
from e2b import AsyncSandbox, CommandExitException, ConnectionConfig
from harbor.constants import MAIN_SERVICE_NAME
from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities
from harbor.environments.compose_service_ops import ComposeServiceOpsMixin
from harbor.environments.definition import (
    COMPOSE_FILE_NAME,
    DOCKERFILE_NAME,
    require_agent_environment_definition,
    should_use_prebuilt_docker_image,
)
from harbor.environments.dind_compose import DinDComposeOps
from harbor.environments.docker.compose_env import ComposeInfraEnvVars, merge_compose_env
from harbor.environments.options import EnvironmentOptions
from harbor.environments.tar_transfer import (
    extract_dir_from_file,
    pack_dir_to_bytes,
    remote_pack_command,
    remote_unpack_command,
    tar_pack_succeeded,
)
from harbor.models.task.config import NetworkMode
from harbor.models.trial.paths import EnvironmentPaths
from pydantic import Field

from aenv.integrations.compose_layers import interpolate, merge_files

COMPOSE_DIR = "/harbor/compose"
PROJECT_FILE = f"{COMPOSE_DIR}/docker-compose.yaml"
ENVIRONMENT_DIR = "/harbor/environment"  # the task's environment/, the build context of ``main``
ROUTE_DIR = "/var/lib/aenv-compose"  # where the route leaves the checked file (docs/docker.md)
KEEP_RUNNING = ["sh", "-c", "sleep infinity"]
_UNSAFE = re.compile(r"[^a-z0-9_-]")


class AenvComposeOptions(EnvironmentOptions):
    """``--ek NAME=VALUE`` options of :class:`AenvComposeEnvironment`."""

    mode: Literal["route", "sdk"] = Field(default="route", description="route: aenv's POST /sandboxes-compose; "
                                          "sdk: docker compose up in a docker-template sandbox")  # fmt: skip
    template: str = Field(default="docker", description="the template with Docker and Compose")
    registry_mirror: str | None = Field(default=None, description="sdk mode: dockerd's registry mirror "
                                        "(e.g. http://10.0.2.2:5000, reachable through private egress)")  # fmt: skip
    sandbox_timeout_sec: int = Field(default=3600, gt=0, description="the sandbox's timeout, renewed while it runs")
    renew_interval_sec: float = Field(default=600.0, ge=0, description="seconds between renewals; 0: none")
    up_timeout_sec: int = Field(default=600, gt=0, le=3600, description="bound on bringing the services up")


class _SandboxCompose(DinDComposeOps):
    """Harbor's Compose operations, with the sandbox as the Docker host: its primitives run through the
    E2B SDK (commands as root; files through envd, directories as one tar archive)."""

    _MAIN_LOGIN_SHELL = False  # as `docker exec`: the image's PATH and environment, not /etc/profile's
    _CP_DIR_TIMEOUT_SEC = 300

    def __init__(self, env: AenvComposeEnvironment) -> None:
        self._env = env
        self.compose = ["docker", "compose"]  # + the project, its file and directory once started

    def _sandbox(self) -> AsyncSandbox:
        if self._env._sandbox is None:
            raise RuntimeError("the aenv sandbox is not running: start the environment first")
        return self._env._sandbox

    async def _host_exec(self, command: str, timeout_sec: int | None = None) -> ExecResult:
        try:
            res = await self._sandbox().commands.run(command, user="root", cwd="/", timeout=timeout_sec or 0)
        except CommandExitException as exc:
            res = exc
        return ExecResult(stdout=res.stdout, stderr=res.stderr, return_code=res.exit_code)

    async def _compose_exec(self, subcommand: list[str], timeout_sec: int | None = None) -> ExecResult:
        return await self._host_exec(shlex.join([*self.compose, *subcommand]), timeout_sec)

    async def _stage_file_to_host(self, source_path: Path | str, host_path: str) -> None:
        await self._sandbox().files.write(host_path, Path(source_path).read_bytes(), user="root")

    async def _stage_dir_to_host(self, source_dir: Path | str, host_dir: str) -> None:
        archive = await asyncio.to_thread(pack_dir_to_bytes, Path(source_dir), compress=True, include_root=False)
        remote = f"/tmp/harbor_stage_{uuid4().hex}.tar.gz"
        await self._sandbox().files.write(remote, archive.getvalue(), user="root")
        res = await self._host_exec(f"{remote_unpack_command(remote, host_dir)}; s=$?; rm -f {remote}; exit $s", 300)
        if res.return_code != 0:
            raise RuntimeError(f"unpacking {source_dir} into the sandbox's {host_dir} failed: {res.stderr}")

    async def write_project(self, project: dict[str, Any]) -> None:
        """The merged project where every later ``docker compose`` call reads it."""
        text = yaml.safe_dump(project, sort_keys=False)
        await self._sandbox().files.write(PROJECT_FILE, text.encode(), user="root")

    async def _fetch_file_from_host(self, host_path: str, target_path: Path | str) -> None:
        data = await self._sandbox().files.read(host_path, format="bytes", user="root")
        Path(target_path).write_bytes(bytes(data))

    async def _fetch_dir_from_host(self, host_dir: str, target_dir: Path | str) -> None:
        remote = f"/tmp/harbor_fetch_{uuid4().hex}.tar.gz"
        try:
            res = await self._host_exec(remote_pack_command(host_dir, remote), 300)
            if not tar_pack_succeeded(res.return_code, stdout=res.stdout, stderr=res.stderr,
                                      logger=self._env.logger):  # fmt: skip
                raise RuntimeError(f"packing the sandbox's {host_dir} failed: {res.stderr}")
            with tempfile.TemporaryDirectory() as tmp:
                local = Path(tmp) / "fetch.tar.gz"
                await self._fetch_file_from_host(remote, local)
                await asyncio.to_thread(extract_dir_from_file, local, Path(target_dir))
        finally:
            await self._remove_host_path(remote, directory=False)


class AenvComposeEnvironment(ComposeServiceOpsMixin, BaseEnvironment):
    """A task's Compose project in one aenv sandbox; ``main`` is where Harbor's agent and verifier run."""

    options_model = AenvComposeOptions
    options: AenvComposeOptions

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sandbox: AsyncSandbox | None = None
        self._renew: asyncio.Task[None] | None = None
        self._ops = _SandboxCompose(self)
        self.project_name = _UNSAFE.sub("-", self.session_id.lower()).strip("-_") or "harbor"

    @staticmethod
    def type() -> str:
        return "aenv-compose"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(docker_compose=True, disable_internet=True)

    @property
    def _uses_compose(self) -> bool:
        return True  # the task's env goes into the project (interpolation, main's environment)

    def _validate_definition(self) -> None:
        require_agent_environment_definition(self.environment_dir, docker_image=self.task_env_config.docker_image,
                                             extra_docker_compose_paths=self.extra_docker_compose_paths)  # fmt: skip

    def _compose_service_transport(self, service: str | None) -> _SandboxCompose:
        return self._ops

    # -- the project ------------------------------------------------------------------------------------

    def project(self, force_build: bool = False) -> dict[str, Any]:
        """Harbor's layers merged into the one project the sandbox runs (public for tests)."""
        prebuilt = should_use_prebuilt_docker_image(self.environment_dir, docker_image=self.task_env_config.docker_image,
                                                    force_build=force_build)  # fmt: skip
        main: dict[str, Any] = {"command": KEEP_RUNNING}
        if prebuilt:
            main["image"] = self.task_env_config.docker_image
        elif (self.environment_dir / DOCKERFILE_NAME).exists():
            main.update(build={"context": ENVIRONMENT_DIR}, image=f"hb__{self.project_name}")
            if self.options.mode == "sdk":
                main["pull_policy"] = "build"  # always built, never looked up in a registry
        layers: list[dict[str, Any]] = [{"name": self.project_name, "services": {MAIN_SERVICE_NAME: main}}]
        variables = merge_compose_env(user_env=self._startup_env(), infra_env=self._infra_env(prebuilt),
                                      logger=self.logger)  # fmt: skip
        files = [self.environment_dir / COMPOSE_FILE_NAME, *self.extra_docker_compose_paths]
        for path in (p for p in files if p.exists()):
            layers.append(interpolate(yaml.safe_load(path.read_text()) or {}, variables))
        if startup := self._startup_env():  # literal values: "$" escaped for Compose's own interpolation
            env = {k: v.replace("$", "$$") for k, v in startup.items()}
            layers.append({"services": {MAIN_SERVICE_NAME: {"environment": env}}})
        return merge_files(layers)

    def build_contexts(self, project: dict[str, Any]) -> dict[str, str]:
        """Each ``build:`` service's context (``main``'s: the task's environment/; another's: its path
        under it) as the base64 gzip tar the route takes."""
        out: dict[str, str] = {}
        for name, svc in project.get("services", {}).items():
            build = (svc or {}).get("build")
            if build is None:
                continue
            context = build if isinstance(build, str) else build.get("context", ".")
            path = self.environment_dir if context == ENVIRONMENT_DIR else (self.environment_dir / context).resolve()
            if not path.is_dir() or not path.is_relative_to(self.environment_dir.resolve()):
                raise ValueError(f"services.{name}.build: context {context!r} is not a directory under "
                                 f"{self.environment_dir}")  # fmt: skip
            data = pack_dir_to_bytes(path, compress=True, include_root=False).getvalue()
            out[name] = base64.b64encode(data).decode()
        return out

    def _infra_env(self, prebuilt: bool) -> dict[str, str]:
        """The variables Harbor's Docker environments give a task's compose file."""
        memory = self._effective_memory_mb
        return ComposeInfraEnvVars(
            main_image_name=f"hb__{self.project_name}", context_dir=ENVIRONMENT_DIR,
            prebuilt_image_name=self.task_env_config.docker_image if prebuilt else None,
            cpus=self._effective_cpus, memory=f"{memory}M" if memory else None,
        ).to_env_dict()  # fmt: skip

    # -- lifecycle ----------------------------------------------------------------------------------

    async def start(self, force_build: bool) -> None:
        project = self.project(force_build)
        offline = self.network_policy.network_mode == NetworkMode.NO_NETWORK
        metadata = {"harbor.session_id": self.session_id, "harbor.environment_name": self.environment_name}
        if self.options.mode == "route":
            await self._start_by_route(project, offline, metadata)
        else:
            await self._start_by_sdk(project, offline, metadata)
        if self.options.renew_interval_sec > 0:
            self._renew = asyncio.create_task(self._renew_loop())
        # what a Docker environment's log mounts would have made: Harbor copies into and out of them
        paths = EnvironmentPaths.for_os(self.os)
        await self.ensure_dirs([paths.agent_dir, paths.verifier_dir, paths.artifacts_dir])
        await self._upload_environment_dir_after_start()

    async def _start_by_route(self, project: dict[str, Any], offline: bool, metadata: dict[str, str]) -> None:
        """``POST /sandboxes-compose`` (docs/docker.md): answered once every service is up, healthy where it
        has a healthcheck; a project that fails is torn down by aenv and answered as an error."""
        cfg = ConnectionConfig()
        body: dict[str, Any] = {
            "templateID": self.options.template, "compose": yaml.safe_dump(project, sort_keys=False),
            "timeout": self.options.sandbox_timeout_sec, "metadata": metadata, "allow_internet_access": not offline,
            "startupTimeout": self.options.up_timeout_sec,
        }  # fmt: skip
        if contexts := await asyncio.to_thread(self.build_contexts, project):
            body["buildContexts"] = contexts
        async with httpx.AsyncClient(base_url=cfg.api_url, timeout=self.options.up_timeout_sec + 120,
                                     headers={"X-API-Key": cfg.api_key or ""}) as client:  # fmt: skip
            resp = await client.post("/sandboxes-compose", json=body)
        if resp.status_code >= 400:
            raise RuntimeError(f"aenv POST /sandboxes-compose answered {resp.status_code}: {resp.text[-3000:]}")
        answer = resp.json()
        self._sandbox = await AsyncSandbox.connect(answer["sandboxID"])
        self.project_name = answer["compose"]["project"]
        self._ops.compose += ["-p", self.project_name, "-f", f"{ROUTE_DIR}/compose.yaml",
                              "--project-directory", ROUTE_DIR]  # fmt: skip

    async def _start_by_sdk(self, project: dict[str, Any], offline: bool, metadata: dict[str, str]) -> None:
        self._sandbox = await AsyncSandbox.create(self.options.template, timeout=self.options.sandbox_timeout_sec,
                                                  metadata=metadata, allow_internet_access=not offline)  # fmt: skip
        self._ops.compose += ["-p", self.project_name, "-f", PROJECT_FILE, "--project-directory", ENVIRONMENT_DIR]
        try:
            await self._ops._stage_dir_to_host(self.environment_dir, ENVIRONMENT_DIR)
            await self._ops.write_project(project)
            if self.options.registry_mirror:
                await self._use_mirror(self.options.registry_mirror)
            up = await self._ops._compose_exec(["up", "-d", "--wait"], self.options.up_timeout_sec)
            if up.return_code != 0:
                raise RuntimeError(f"docker compose up failed in the sandbox: {(up.stdout or '')[-2000:]}"
                                   f"{(up.stderr or '')[-2000:]}")  # fmt: skip
        except BaseException:
            await self.stop(delete=True)
            raise

    async def _use_mirror(self, mirror: str) -> None:
        """Point the sandbox's dockerd at ``mirror`` (a plain-HTTP one trusted): daemon.json, then SIGHUP,
        which makes dockerd reload both settings without a restart."""
        host = re.sub(r"^[a-z]+://", "", mirror).rstrip("/")
        script = (
            "import json, os; p = '/etc/docker/daemon.json'\n"
            "c = json.load(open(p)) if os.path.exists(p) else {}\n"
            f"c['registry-mirrors'] = [{mirror!r}]; c['insecure-registries'] = [{host!r}]\n"
            "os.makedirs('/etc/docker', exist_ok=True); json.dump(c, open(p, 'w'))\n"
        )
        res = await self._ops._host_exec(f"python3 -c {shlex.quote(script)} && kill -HUP $(cat /var/run/docker.pid)", 30)
        if res.return_code != 0:
            raise RuntimeError(f"setting dockerd's registry mirror failed: {res.stderr}")

    async def _renew_loop(self) -> None:
        while self._sandbox is not None:
            await asyncio.sleep(self.options.renew_interval_sec)
            try:
                if self._sandbox is not None:
                    await self._sandbox.set_timeout(self.options.sandbox_timeout_sec)
            except Exception as exc:  # noqa: BLE001 - the next renewal may work; the trial goes on
                self.logger.warning(f"aenv sandbox timeout renewal failed: {exc}")

    async def stop(self, delete: bool) -> None:
        """Kill the sandbox: every service goes with it (aenv sandboxes are not kept on ``delete=False``)."""
        if self._renew is not None:
            self._renew.cancel()
            self._renew = None
        sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None:
            try:
                await sandbox.kill()
            except Exception as exc:  # noqa: BLE001 - it expires at its timeout anyway
                self.logger.warning(f"killing aenv sandbox {sandbox.sandbox_id} failed: {exc}")

    # -- operations on main -------------------------------------------------------------------------

    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:  # fmt: skip
        return await self._ops.exec(command, cwd=cwd or self.task_env_config.workdir, env=self._merge_env(env),
                                    timeout_sec=timeout_sec, user=self._resolve_user(user))  # fmt: skip

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        await self._ops.upload_file(source_path, target_path)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        await self._ops.upload_dir(source_dir, target_dir)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        await self._ops.download_file(source_path, target_path)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        await self._ops.download_dir(source_dir, target_dir)

    async def is_dir(self, path: str, user: str | int | None = None) -> bool:
        return await self._ops.is_dir(path, user=self._resolve_user(user))

    async def is_file(self, path: str, user: str | int | None = None) -> bool:
        return await self._ops.is_file(path, user=self._resolve_user(user))


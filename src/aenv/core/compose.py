"""Compose sandboxes: a Docker Compose project running inside one sandbox of a template with Docker inside
(``docker``), answered only once every service is up (``docker compose up --wait``).

Flow (``POST /sandboxes-compose``, ``aenv compose up``)::

    check the file and contexts (compose_spec, compose_build: every refusal a 400, nothing started)
    fetch every image on the host (the registry client: mirrors, credentials; blobs cached per node)
    create the sandbox (an ordinary create: quotas, admission, TTL, metadata)
    upload one ``docker load`` archive, the contexts and the checked file → docker load → compose up --wait
    read the services' states (``docker compose ps``) → the answer

Any failure after the create (an image docker refuses, a service that exits or stays unhealthy, the
startup timeout, the client going away) kills the sandbox before the error is answered, with the tail
of Compose's output in the message: no half-up sandbox is left running. Nothing in the sandbox pulls:
the file is run with ``--pull never``, and builds use the classic builder, which takes its base image
from those loaded (``DOCKER_BUILDKIT=0``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shlex
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from aenv.config import Settings
from aenv.core.compose_build import Context, check_context, dockerfile_bases, rewrite_bases
from aenv.core.compose_spec import ComposeLimits, ComposeProject, parse_project
from aenv.core.models import CreateRequest
from aenv.core.table import LiveSandbox
from aenv.errors import AenvError, ImageError, InvalidRequest, RuntimeFailure
from aenv.images import ImageBuilder
from aenv.images.cache import pull_owner
from aenv.images.docker_archive import ArchiveImage, archive_chunks, archive_size, fetch_image, members
from aenv.images.reference import Reference, parse_reference
from aenv.mux import ByteStream
from aenv.runtime.envd_client import ENVD_PORT, CommandResult, EnvdError, run_command, upload, upload_stream

log = logging.getLogger("aenv.core")

WORKDIR = "/var/lib/aenv-compose"
LOG = "/var/log/aenv-compose.log"
TAIL = 3000  # characters of Compose's output an error carries
LOAD_TIMEOUT_S = 600


class ComposeFailed(RuntimeFailure):
    """The project did not come up; the sandbox was killed. ``reason`` for clients: ``compose``."""

    reason = "compose"


class SandboxDoor(Protocol):
    """What the flow needs of the orchestrator (passed in; no import of it here)."""

    async def create(self, req: CreateRequest) -> LiveSandbox: ...

    async def kill(self, sandbox_id: str, reason: str = ..., detail: str = ...) -> None: ...

    async def open_stream(self, sandbox_id: str, port: int) -> ByteStream: ...


@dataclass(frozen=True)
class ComposeRequest:
    create: CreateRequest  # the sandbox's own fields (template ``docker`` unless said otherwise)
    compose: str  # the file's text
    env: dict[str, str] = field(default_factory=dict)  # interpolation (``composeEnv``)
    profiles: tuple[str, ...] = ()
    contexts: dict[str, bytes] = field(default_factory=dict)  # service → build context tar
    startup_timeout: float | None = None


@dataclass(frozen=True)
class ServicePort:
    target: int
    published: int
    protocol: str


@dataclass(frozen=True)
class ServiceState:
    name: str
    state: str  # running, exited, created... ("not started": left out by its profiles)
    health: str = ""  # healthy, unhealthy, starting, or "" without a healthcheck
    exit_code: int | None = None
    ports: tuple[ServicePort, ...] = ()


@dataclass(frozen=True)
class ComposeResult:
    sandbox: LiveSandbox
    project: str
    services: tuple[ServiceState, ...]


class ComposeFlows:
    def __init__(self, settings: Settings, door: SandboxDoor, images: ImageBuilder) -> None:
        self.settings = settings
        self.door = door
        self.images = images
        self.limits = ComposeLimits(max_bytes=settings.compose_max_bytes, max_services=settings.compose_max_services)

    def check(self, req: ComposeRequest) -> tuple[ComposeProject, list[Context]]:
        """Every 400 a request can get, before anything is fetched or started."""
        if len(req.profiles) > 32 or any(not p or len(p) > 64 for p in req.profiles):
            raise InvalidRequest("profiles: at most 32 names of 1-64 characters")
        total = sum(len(d) for d in req.contexts.values())
        if total > self.settings.compose_max_context_bytes:
            raise InvalidRequest(f"buildContexts: {total} bytes, the limit is {self.settings.compose_max_context_bytes}")
        project = parse_project(req.compose, req.env, self.limits, contexts=frozenset(req.contexts))
        contexts = []
        left = self.settings.compose_max_context_bytes
        for name, data in req.contexts.items():
            build = project.services[name].build
            assert build is not None  # parse_project refused contexts of services without a build
            ctx = check_context(name, data, build.dockerfile, left)
            left -= ctx.unpacked_bytes
            if ctx.dockerfile is None and not build.inline:
                raise InvalidRequest(f"buildContexts.{name}: no {build.dockerfile} in the context")
            contexts.append(ctx)
        return project, contexts

    def base_images(self, project: ComposeProject, contexts: list[Context]) -> list[str]:
        """The images the builds start from (their Dockerfiles' ``FROM``), which the node fetches too."""
        texts = {c.service: c.dockerfile for c in contexts}
        out: list[str] = []
        for name, svc in project.services.items():
            if svc.build is None:
                continue
            text = project.document["services"][name]["build"].get("dockerfile_inline") if svc.build.inline else None
            text = str(text) if text is not None else texts.get(name)
            out += dockerfile_bases(text or "", svc.build.args)
        return out

    async def up(self, req: ComposeRequest) -> ComposeResult:
        project, contexts = self.check(req)
        images = list(dict.fromkeys([*project.images(), *self.base_images(project, contexts)]))
        timeout = req.startup_timeout or self.settings.compose_startup_timeout
        deadline = time.monotonic() + timeout
        owner = pull_owner()
        try:
            async with asyncio.timeout(timeout):
                fetched = await self._fetch(project, images, owner)
                sbx = await self.door.create(req.create)
                try:
                    services = await self._start(sbx, project, fetched, contexts, req.profiles, deadline)
                except BaseException as exc:
                    with contextlib.suppress(Exception):
                        await asyncio.shield(self.door.kill(sbx.id, detail=f"compose up failed: {str(exc)[:200]}"))
                    raise
        except TimeoutError:
            raise ComposeFailed(f"compose up: not up within the startup timeout of {timeout:.0f} s; the sandbox "
                                "was removed") from None
        finally:
            self.images.cache.unpin(owner)
        log.info("sandbox=%s compose project=%s up services=%d", sbx.id, project.name, len(services))
        return ComposeResult(sbx, project.name, services)

    async def _fetch(self, project: ComposeProject, images: list[str], owner: str) -> dict[str, ArchiveImage]:
        """Every image, by the name the file uses, fetched on the host (pinned under ``owner``)."""
        async def one(image: str) -> ArchiveImage:
            try:
                return await fetch_image(self.images.client, self.images.cache, image, local_tag(image), owner)
            except ImageError as exc:
                users = [n for n, s in project.services.items() if s.image == image] or ["(a build's FROM)"]
                raise ImageError(f"compose services.{users[0]}.image '{image}': {exc}") from None

        fetched = await asyncio.gather(*(one(image) for image in images), return_exceptions=True)
        for got in fetched:
            if isinstance(got, BaseException):
                raise got
        return {image: got for image, got in zip(images, fetched, strict=True) if isinstance(got, ArchiveImage)}

    async def _start(self, sbx: LiveSandbox, project: ComposeProject, images: dict[str, ArchiveImage],
                     contexts: list[Context], profiles: tuple[str, ...], deadline: float) -> tuple[ServiceState, ...]:
        if not sbx.spec.template.nested_containers:
            raise InvalidRequest(f"templateID: template '{sbx.row.template_id}' has no Docker inside "
                                 "(use 'docker': aenv template build docker)")
        token = sbx.row.access_token
        if images:
            files = members(list(images.values()))
            stream = await self.door.open_stream(sbx.id, ENVD_PORT)
            await upload_stream(stream, f"{WORKDIR}/images.tar", archive_size(files), archive_chunks(files), token=token)
            res = await self._sh(sbx, f"docker load -i {WORKDIR}/images.tar; rc=$?; rm -f {WORKDIR}/images.tar; "
                                 "exit $rc", min(LOAD_TIMEOUT_S, _left(deadline)))
            if res.exit_code != 0:
                raise ComposeFailed(f"docker load failed in the sandbox: {_tail(res)}")
        unpack = [f"mkdir -p {shlex.quote(f'{WORKDIR}/build/{name}')}"  # dockerfile_inline: an empty context
                  for name, svc in project.services.items() if svc.build is not None]
        for ctx in contexts:
            stream = await self.door.open_stream(sbx.id, ENVD_PORT)
            await upload(stream, f"{WORKDIR}/build/{ctx.service}.tar", ctx.data, token=token)
            tar, dest = shlex.quote(f"{WORKDIR}/build/{ctx.service}.tar"), shlex.quote(f"{WORKDIR}/build/{ctx.service}")
            unpack.append(f"mkdir -p {dest} && tar -xf {tar} -C {dest} --no-same-owner && rm -f {tar}")
        pinned = {image: im.tags[0] for image, im in images.items() if parse_reference(image).digest}
        for ctx in contexts:  # a FROM pinned by digest names the tag it was loaded under
            build = project.services[ctx.service].build
            if pinned and ctx.dockerfile is not None and build is not None:
                rewritten = rewrite_bases(ctx.dockerfile, pinned)
                if rewritten != ctx.dockerfile:
                    stream = await self.door.open_stream(sbx.id, ENVD_PORT)
                    path = f"{WORKDIR}/build/{ctx.service}/{build.dockerfile.removeprefix('./')}"
                    await upload(stream, path + ".aenv", rewritten.encode(), token=token)
                    unpack.append(f"mv -f {shlex.quote(path + '.aenv')} {shlex.quote(path)}")
        text = project.render({name: im.tags[0] for name, im in images.items()},
                              {n: f"{WORKDIR}/build/{n}" for n, s in project.services.items() if s.build is not None})
        stream = await self.door.open_stream(sbx.id, ENVD_PORT)
        await upload(stream, f"{WORKDIR}/compose.yaml", text.encode(), token=token)
        if unpack:
            res = await self._sh(sbx, " && ".join(unpack), min(120.0, _left(deadline)))
            if res.exit_code != 0:
                raise ComposeFailed(f"unpacking the build contexts failed: {_tail(res)}")
        compose = compose_command(project.name, profiles)
        wait = max(1, int(_left(deadline)) - 5)
        res = await self._sh(sbx, f"{compose} up -d --wait --wait-timeout {wait} --pull never >{LOG} 2>&1; rc=$?; "
                             f"tail -c {TAIL} {LOG}; exit $rc", _left(deadline))
        if res.exit_code != 0:
            raise ComposeFailed(f"compose up failed (exit {res.exit_code}); the sandbox was removed: "
                                f"{_tail(res)}{await self._diagnose(sbx, compose)}")
        ps = await self._sh(sbx, f"{compose} ps -a --format json", 30.0)
        return service_states(project, ps.stdout.decode(errors="replace"))

    async def _diagnose(self, sbx: LiveSandbox, compose: str) -> str:
        """The states and last log lines of the services, for the error (best effort)."""
        try:
            res = await self._sh(sbx, f"{compose} ps -a 2>&1; {compose} logs --no-color --tail 15 2>&1 | tail -c {TAIL}", 20.0)
        except (AenvError, EnvdError, OSError, TimeoutError):
            return ""
        return f"\n--- services ---\n{res.stdout.decode(errors='replace')[-TAIL:]}"

    async def _sh(self, sbx: LiveSandbox, cmd: str, timeout: float) -> CommandResult:
        stream = await self.door.open_stream(sbx.id, ENVD_PORT)
        async with asyncio.timeout(max(1.0, timeout)):
            return await run_command(stream, f"mkdir -p {WORKDIR} && cd {WORKDIR} && {cmd}", user="root",
                                     envs={"DOCKER_BUILDKIT": "0", "COMPOSE_ANSI": "never"}, token=sbx.row.access_token)


def compose_command(project: str, profiles: tuple[str, ...]) -> str:
    """``docker compose`` on the checked file, for the project: the start and what a client types later."""
    parts = ["docker", "compose", "-p", project, "-f", f"{WORKDIR}/compose.yaml", "--project-directory", WORKDIR]
    for p in profiles:
        parts += ["--profile", p]
    return shlex.join(parts)


def local_tag(image: str) -> str:
    """The name ``docker load`` gives ``image`` and the checked file then uses: the reference with its tag
    (``busybox`` → ``docker.io/library/busybox:latest``, which Docker shows as ``busybox:latest``); one
    pinned by digest gets a tag of its digest, since ``docker load`` cannot record a digest."""
    ref = parse_reference(image)
    if ref.digest:
        return str(Reference(ref.registry, ref.repository, "aenv-" + ref.digest.split(":")[-1][:16]))
    return str(Reference(ref.registry, ref.repository, ref.tag))


def service_states(project: ComposeProject, ps_json: str) -> tuple[ServiceState, ...]:
    """``docker compose ps --format json`` (a JSON array, or one object a line in newer Compose) as one
    state per service of the file, in the file's order."""
    rows: list[dict[str, Any]] = []
    text = ps_json.strip()
    if text.startswith("["):
        with contextlib.suppress(ValueError):
            rows = [r for r in json.loads(text) if isinstance(r, dict)]
    else:
        for line in text.splitlines():
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if isinstance(row, dict):
                    rows.append(row)
    by_service = {str(r.get("Service")): r for r in rows}
    out = []
    for name in project.services:
        row = by_service.get(name)
        if row is None:
            out.append(ServiceState(name, "not started"))
            continue
        ports = {ServicePort(int(p["TargetPort"]), int(p["PublishedPort"]), str(p.get("Protocol") or "tcp"))
                 for p in row.get("Publishers") or [] if isinstance(p, dict) and p.get("PublishedPort")}
        code = row.get("ExitCode")
        out.append(ServiceState(name, str(row.get("State") or ""), str(row.get("Health") or ""),
                                int(code) if isinstance(code, int) else None,
                                tuple(sorted(ports, key=lambda p: (p.published, p.protocol)))))
    return tuple(out)


def _left(deadline: float) -> float:
    return max(1.0, deadline - time.monotonic())


def _tail(res: CommandResult) -> str:
    text = (res.stdout + res.stderr).decode(errors="replace").strip()
    if res.error:
        text = f"{text}\n{res.error}".strip()
    return text[-TAIL:] or f"exit {res.exit_code}"

"""The ASGI application: control plane (FastAPI) behind the sandbox proxy, sharing one port.

The lifespan owns the long-lived objects: store → runtime → orchestrator, closed in reverse order.
Routes talk to the orchestrator only (``deps.orchestrator``).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from aenv import __version__
from aenv.api import console, errors, serialize
from aenv.api.auth import principal, require_api_key
from aenv.api.proxy import SandboxProxy
from aenv.api.routes_builds import router as builds_router
from aenv.api.routes_builds import uploads as build_uploads_router
from aenv.api.routes_cluster import router as cluster_router
from aenv.api.routes_compose import router as compose_router
from aenv.api.routes_console import EventHub
from aenv.api.routes_console import router as console_read_router
from aenv.api.routes_console_ops import router as console_ops_router
from aenv.api.routes_fleet import router as fleet_router
from aenv.api.routes_leases import router as leases_router
from aenv.api.routes_sandboxes import router as sandboxes_router
from aenv.api.routes_secrets import router as secrets_router
from aenv.api.routes_snapshots import router as snapshots_router
from aenv.api.routes_teams import router as teams_router
from aenv.api.routes_teams import team_metrics
from aenv.api.routes_templates import router as templates_router
from aenv.api.routes_volumes import control as volumes_router
from aenv.api.routes_volumes import router as volume_content_router
from aenv.api.routes_webhooks import router as webhooks_router
from aenv.config import Settings
from aenv.core import network as net
from aenv.core.leases import Leases
from aenv.core.orchestrator import Orchestrator
from aenv.core.run_metrics import RunMetrics
from aenv.core.sandbox_logs import SandboxLogs
from aenv.core.templates import TemplateCatalog
from aenv.core.webhooks import Webhooks
from aenv.runtime.base import Runtime
from aenv.store.sqlite import Store

log = logging.getLogger("aenv.api")


def _cluster_directory(settings: Settings) -> Any:
    """Cluster mode (``cluster_redis``): this node registered under a new incarnation, else None."""
    if not settings.cluster_redis:
        return None
    import socket

    from aenv.directory.node import NodeDirectory, connect

    node_id = settings.cluster_node_id or socket.gethostname()
    url = settings.cluster_url or f"http://{settings.host}:{settings.port}"
    directory = NodeDirectory(connect(settings.cluster_redis), node_id, url)
    directory.register()
    return directory


def _snapshot_repository(settings: Settings) -> Any:
    """The snapshot repository from ``snapshot_store`` (keys from the environment), or None if off."""
    from aenv.snapshots.repository import describe_store, repository_from_settings

    repository = repository_from_settings(settings)
    if repository is None:
        log.info("snapshot repository: off (snapshot_store is empty)")
    else:
        log.info("snapshot repository: %s", describe_store(repository.url))
    return repository


def create_app(settings: Settings, runtime: Runtime | None = None, *, ensure_base: bool = True,
               freeze_startup: bool = False) -> Any:
    """Build the ASGI app. ``runtime`` may be injected (tests); otherwise chosen from settings.
    ``freeze_startup`` (``aenv serve``'s own process, not a test's): once started, what startup made
    (modules, classes, routes, pydantic models: ~120,000 objects) moves to the collector's permanent
    generation; it lives as long as the process, and each full collection walked all of it with the event
    loop stopped (20-110 ms a time at 400 sandboxes)."""
    holder: dict[str, Any] = {}  # orch (the Orchestrator), runs (RunMetrics), once started

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        import asyncio

        from aenv.runtime.select import make_runtime

        settings.state_dir.mkdir(parents=True, exist_ok=True)
        directory = _cluster_directory(settings)
        store = Store(settings.db_path, binder=directory)
        catalog = TemplateCatalog(settings, store)
        rt = runtime or make_runtime(settings)
        orch = Orchestrator(settings, store, rt, catalog)
        if ensure_base:
            await asyncio.to_thread(orch.ensure_base_template)  # base, and code-interpreter-v1 if built
        orch.on_running.append(proxy.prewarm)
        webhooks = Webhooks(settings, store)
        orch.on_event.append(webhooks.emit)
        repository = _snapshot_repository(settings)
        if repository is not None:
            orch.attach_repository(repository)
        handover = None
        if directory is not None and repository is not None and settings.snapshot_store:  # a store shared by nodes
            from aenv.core.handover import PauseHandover

            handover = PauseHandover(orch, directory)
            orch.on_event.append(handover.on_event)
        leases = Leases(settings, store, orch.kill_matching)
        orch.on_event.append(leases.on_event)
        runs = RunMetrics(settings.admission_group_key)
        orch.on_event.append(runs.on_event)
        logs = SandboxLogs(store, settings.gone_retention)
        orch.on_event.append(logs.on_event)
        orch.on_event.append(app.state.console_events.on_event)
        await logs.start()
        orch.admission.on_refused = runs.on_refused
        await orch.start()
        await webhooks.start()  # first what a killed server left pending
        await leases.start()
        holder["orch"] = orch
        holder["directory"] = directory
        holder["runs"] = runs
        app.state.webhooks = webhooks
        app.state.leases = leases
        app.state.run_metrics = runs
        app.state.sandbox_logs = logs
        app.state.orchestrator = orch
        app.state.handover = handover
        app.state.catalog = catalog
        app.state.settings = settings
        app.state.background = set()
        app.state.teams = orch.admission.teams  # keys -> teams (auth.py), the same that holds the quotas
        log.info("aenv %s serving with runtime=%s state=%s", __version__, rt.name, settings.state_dir)
        if freeze_startup:
            gc.collect()
            gc.freeze()
        try:
            yield
        finally:
            for task in list(app.state.background):
                task.cancel()
            await proxy.aclose()
            await leases.close()
            if handover is not None:
                await handover.aclose()
            await orch.close()
            await logs.close()
            await webhooks.close()
            store.close()
            if directory is not None:
                directory.close()

    api = FastAPI(title="aenv", version=__version__, lifespan=lifespan)
    errors.install(api)
    # builds first: their /templates/tags routes must win over DELETE /templates/{id:path}
    api.include_router(builds_router)
    api.include_router(build_uploads_router)
    api.include_router(sandboxes_router)
    api.include_router(compose_router)
    api.include_router(fleet_router)
    api.include_router(cluster_router)
    api.include_router(leases_router)
    api.include_router(templates_router)
    api.include_router(snapshots_router)
    api.include_router(webhooks_router)
    api.include_router(volumes_router)
    api.include_router(volume_content_router)
    api.include_router(secrets_router)
    api.include_router(teams_router)
    api.include_router(console_read_router)
    api.include_router(console_ops_router)
    api.state.console_events = EventHub()
    console.install(api, "node")

    @api.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok", "version": __version__})

    @api.get("/metrics", response_class=PlainTextResponse)
    async def prometheus(request: Request) -> PlainTextResponse:
        if not settings.metrics_public:  # the config promises a key-protected /metrics when asked
            await require_api_key(request)
        orch = holder.get("orch")
        lines = ["# HELP aenv_sandboxes Sandboxes by state", "# TYPE aenv_sandboxes gauge"]
        if orch is not None:
            for state, n in orch.stats()["sandboxes"].items():
                lines.append(f'aenv_sandboxes{{state="{state}"}} {n}')
            lines += ["# TYPE aenv_sandboxes_starting gauge", f"aenv_sandboxes_starting {orch.stats()['starting']}"]
            lines += holder["runs"].prometheus(s.row for s in orch.table)
            lines += orch.ksm.prometheus()
            lines += team_metrics(orch.admission)
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @api.get("/aenv/info", dependencies=[Depends(require_api_key)])
    async def info(request: Request) -> JSONResponse:
        orch = holder["orch"]
        out = {"version": __version__, **orch.stats(), "capabilities": orch.capabilities(), "ksm": orch.ksm.stats(),
               "network": net.private_info(settings)}
        if principal(request).admin:  # what each team holds here: a gateway sums it for quotas across nodes
            out["teams"] = {t: {"sandboxes": u.sandboxes, "vcpus": u.vcpus, "memoryMB": u.memory_mb}
                            for t, u in orch.admission.usage_by_team().items()}  # fmt: skip
        if (directory := holder.get("directory")) is not None:
            out["cluster"] = {"nodeID": directory.node_id, "incarnation": directory.incarnation}
        return JSONResponse(out)

    api.add_middleware(_SandboxDomain, configured=settings.sandbox_domain)
    # FastAPI's ASGI types are wider
    proxy = SandboxProxy(api, lambda: holder["orch"], settings.ws_max_message)  # type: ignore[arg-type]
    return proxy


class _SandboxDomain:
    """ASGI middleware: each control-plane request is answered with the sandbox domain its client should
    use (``serialize.DOMAIN``, read where responses name a sandbox's ``domain``)."""

    def __init__(self, app: Any, configured: str | None) -> None:
        self.app = app
        self.configured = configured

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        server = scope.get("server") or (None, None)
        token = serialize.DOMAIN.set(serialize.domain_for(scope["headers"], server[1], self.configured))
        try:
            await self.app(scope, receive, send)
        finally:
            serialize.DOMAIN.reset(token)

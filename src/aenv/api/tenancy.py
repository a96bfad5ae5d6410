"""What a team may see: every object a route's path names is checked before the route runs.

``require_api_key`` (``auth.py``) calls :func:`check_path_objects` for every route of every router, so a
route added later is covered without a line of its own: a path parameter named ``sandbox_id``,
``snapshot_id``, ``template_id``, ``volume_id`` or ``lease_id`` that names another team's object is
answered exactly as an unknown ID is (the same error, raised the same way, before any work). The routes
then act with the principal's team (:func:`owner`) and list with :func:`list_owner`.

Templates are the exception that is shared on purpose: the server's own (``base``,
``code-interpreter-v1``: owner ``''``) and published ones (E2B's ``public``) are every team's to start
sandboxes from; only their owner (or an admin) may change or delete them.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Request
from starlette.exceptions import HTTPException

from aenv.api.auth import principal
from aenv.core.builds import BuildNotFound
from aenv.core.orchestrator import Orchestrator
from aenv.errors import NotFound, SandboxNotFound, SnapshotNotFound, TemplateNotFound
from aenv.store.sqlite import TemplateRow
from aenv.teams import Principal

ADMIN_ONLY = "this route is for the server's operators: it needs one of the admin_keys"


def owner(request: Request) -> str:
    """The team a request's new objects belong to."""
    return principal(request).team


def list_owner(request: Request) -> str | None:
    """Whose objects a list shows: the request's team's, or everyone's (None) for an admin."""
    who = principal(request)
    return None if who.admin else who.team


def require_admin(request: Request) -> None:
    if not principal(request).admin:
        raise HTTPException(403, ADMIN_ONLY)


def template_visible(who: Principal, row: TemplateRow) -> bool:
    """Whether ``who`` may start sandboxes from (and read) the template ``row``."""
    return who.admin or row.owner in ("", who.team) or row.public


def check_template_use(request: Request, name: str) -> None:
    """A create's ``templateID`` (a name, ``name:tag`` or an ID): another team's private one is unknown."""
    who = principal(request)
    if who.admin:
        return
    orch: Orchestrator = request.app.state.orchestrator
    try:
        row = orch.ctx.templates.resolve(name)
    except NotFound:
        return  # the create answers the unknown name itself
    if not template_visible(who, row):
        raise TemplateNotFound(name)


def _sandbox(request: Request, who: Principal, sandbox_id: str) -> None:
    orch: Orchestrator = request.app.state.orchestrator
    try:
        row = orch.get(sandbox_id).row
    except NotFound:
        tomb = orch.gone.find(sandbox_id)
        if tomb is not None and not who.sees(tomb.owner):
            raise SandboxNotFound(sandbox_id) from None  # an ended one of theirs: "never heard of"
        return  # unknown here: the route answers (and a cluster node may adopt it, checked there)
    if not who.sees(row.owner):
        raise SandboxNotFound(sandbox_id)


def _snapshot(request: Request, who: Principal, snapshot_id: str) -> None:
    orch: Orchestrator = request.app.state.orchestrator
    row = orch.store.get_snapshot(snapshot_id)
    if row is not None and not who.sees(row.owner):
        raise SnapshotNotFound(snapshot_id)


def check_snapshot(request: Request, snapshot_id: str) -> None:
    """A snapshot a body names (rollback's ``snapshotID``): another team's is unknown."""
    _snapshot(request, principal(request), snapshot_id)


def check_template_change(request: Request, name: str) -> None:
    """A template a body names to change (tags): only its team's (or an admin's)."""
    who = principal(request)
    if not who.admin:
        _template(request, who, name, change=True)


def _template(request: Request, who: Principal, template_id: str, change: bool | None = None) -> None:
    orch: Orchestrator = request.app.state.orchestrator
    change = request.method not in ("GET", "HEAD") if change is None else change
    build_id = request.path_params.get("build_id")
    # a build in progress has no template row yet: its record says whose it is
    for rec in orch.builds.records():
        if rec.owner not in ("", who.team) and (rec.template_id == template_id or rec.build_id == build_id):
            if isinstance(build_id, str):
                raise BuildNotFound(template_id, build_id)  # what the build routes answer an unknown build
            raise TemplateNotFound(template_id)
    try:
        row = orch.ctx.templates.resolve(template_id)
    except NotFound:
        return
    if not (row.owner == who.team or (not change and template_visible(who, row))):
        raise TemplateNotFound(template_id)


def _volume(request: Request, who: Principal, volume_id: str) -> None:
    orch: Orchestrator = request.app.state.orchestrator
    orch.volumes.get(who.team, volume_id)  # raises exactly what an unknown volume raises


def _lease(request: Request, who: Principal, lease_id: str) -> None:
    request.app.state.leases.get(lease_id, who.team)  # raises exactly what an unknown lease raises


_CHECKS: dict[str, Callable[[Request, Principal, str], None]] = {
    "sandbox_id": _sandbox,
    "snapshot_id": _snapshot,
    "template_id": _template,
    "volume_id": _volume,
    "lease_id": _lease,
}


# Routes that check the owner themselves, where their own first answer comes before it (a node that
# adopts nothing says so for any ID): ``core/handover.py`` refuses another team's sandbox as unknown.
OWN_CHECKS = frozenset({"/aenv/sandboxes/{sandbox_id}/adopt"})


async def check_path_objects(request: Request, who: Principal) -> None:
    """Raise the unknown-ID error for any object of the path that is not ``who``'s to see."""
    if not hasattr(request.app.state, "orchestrator"):
        return  # the gateway: its nodes check
    route = request.scope.get("route")
    if getattr(route, "path", None) in OWN_CHECKS:
        return
    for name, value in request.path_params.items():
        check = _CHECKS.get(name)
        if check is not None and isinstance(value, str):
            check(request, who, value)

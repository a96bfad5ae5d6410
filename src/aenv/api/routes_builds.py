"""E2B template builds: what ``Template.build`` / ``AsyncTemplate.build`` call (request a build, upload
COPY sources, start it, poll its status and logs). The upload link needs no API key (the SDK sends
none there): it carries an HMAC of the files hash, signed with a secret of this server process."""

from __future__ import annotations

import contextlib
import datetime as dt
import hmac
import re
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import Field, StrictBool, StrictInt

from aenv.api import tenancy
from aenv.api.auth import require_api_key
from aenv.api.deps import orchestrator
from aenv.api.models import _Body
from aenv.core.build_spec import FILES_HASH, BuildSpec, Step
from aenv.core.orchestrator import Orchestrator
from aenv.core.templates import split_tag
from aenv.errors import AenvError, InvalidRequest, NotFound
from aenv.store.event_log import LEVELS

router = APIRouter(dependencies=[Depends(require_api_key)])
uploads = APIRouter()  # signed links, no API key

MAX_UPLOAD_BYTES = 8 << 30
BUILD_IDS_HEADER = "X-Aenv-Build-Ids"  # "<templateID> <buildID>": a gateway replays one build on each node
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,63}$")
STATUS_PAGE = 100  # log entries per status call (the SDK keeps polling until none come)


class BuildRequestBody(_Body):
    name: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[a-z0-9][a-z0-9._/-]*(:[A-Za-z0-9._-]+)?$")
    alias: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[a-z0-9][a-z0-9._/-]*$")
    tags: list[str] | None = Field(default=None, max_length=16)
    cpuCount: StrictInt | None = Field(default=None, ge=1, le=64)
    memoryMB: StrictInt | None = Field(default=None, ge=64, le=262144)
    minFreeDiskMb: StrictInt | None = None
    teamID: str | None = None


class StepBody(_Body):
    type: str = Field(min_length=1, max_length=16)
    args: list[str] = Field(default_factory=list, max_length=256)
    filesHash: str | None = None
    force: StrictBool | None = False
    forceUpload: StrictBool | None = None


class BuildStartBody(_Body):
    fromImage: str | None = Field(default=None, min_length=1, max_length=512)
    fromTemplate: str | None = Field(default=None, min_length=1, max_length=256)
    fromImageRegistry: dict[str, Any] | None = None
    force: StrictBool | None = False
    steps: list[StepBody] = Field(default_factory=list, max_length=1000)
    startCmd: str | None = Field(default=None, max_length=65536)
    readyCmd: str | None = Field(default=None, max_length=65536)


@router.post("/v3/templates", status_code=202)
async def request_build(body: BuildRequestBody, request: Request,
                        orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:  # fmt: skip
    name = body.name or body.alias
    if not name:
        raise InvalidRequest("name is required")
    if body.minFreeDiskMb is not None:
        raise InvalidRequest("minFreeDiskMb is not supported: a build sandbox gets the server's default disk")
    ids = None
    if raw := request.headers.get(BUILD_IDS_HEADER):
        parts = raw.split()
        if len(parts) != 2 or not all(_ID.match(p) for p in parts):
            raise InvalidRequest(f"{BUILD_IDS_HEADER}: give '<templateID> <buildID>' (letters, digits, '-')")
        ids = (parts[0], parts[1])
    await orch.check_disk(tenancy.owner(request))
    if ids is None:  # a rebuild of a template built on another node keeps its ID: fetched from the shared store
        with contextlib.suppress(AenvError):
            await orch.shared_templates.fetch(split_tag(name)[0])
    rec = orch.builds.request(name, list(body.tags or []), body.cpuCount, body.memoryMB, ids, tenancy.owner(request))
    return JSONResponse({"templateID": rec.template_id, "buildID": rec.build_id, "public": False,
                         "names": [rec.alias], "aliases": [rec.alias], "tags": rec.tags}, status_code=202)


@router.get("/templates/{template_id}/files/{files_hash}", status_code=201)
async def file_link(template_id: str, files_hash: str, request: Request,
                    orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:
    if not FILES_HASH.match(files_hash):
        raise InvalidRequest("the files hash must be 64 lowercase hex digits (sha256)")
    if orch.builds.file_present(files_hash, template_id):
        return JSONResponse({"present": True}, status_code=201)
    token = orch.builds.upload_token(files_hash)
    url = str(request.url_for("upload_build_file", files_hash=files_hash).include_query_params(token=token))
    return JSONResponse({"present": False, "url": url}, status_code=201)


@uploads.put("/aenv/build-files/{files_hash}", name="upload_build_file", status_code=201)
async def upload_build_file(files_hash: str, request: Request, token: str = Query(default="")) -> Response:
    orch: Orchestrator = request.app.state.orchestrator
    if not FILES_HASH.match(files_hash) or not hmac.compare_digest(token, orch.builds.upload_token(files_hash)):
        raise NotFound("no such upload link")
    await orch.builds.receive_file(files_hash, request.stream(), MAX_UPLOAD_BYTES)
    return Response(status_code=201)


@router.post("/v2/templates/{template_id}/builds/{build_id}", status_code=202)
async def start_build(template_id: str, build_id: str, body: BuildStartBody,
                      orch: Orchestrator = Depends(orchestrator)) -> Response:
    if body.fromImageRegistry:
        raise InvalidRequest("fromImageRegistry (registry credentials per build) is not supported: put them "
                             "in the server's docker config.json (images/auth.py)")
    spec = BuildSpec(
        from_image=body.fromImage, from_template=body.fromTemplate, force=bool(body.force),
        start_cmd=body.startCmd, ready_cmd=body.readyCmd,
        steps=tuple(Step(s.type, tuple(s.args), s.filesHash, bool(s.force)) for s in body.steps),
    )  # fmt: skip
    orch.builds.trigger(template_id, build_id, spec)
    return Response(status_code=202)


@router.get("/templates/{template_id}/builds/{build_id}/status")
async def build_status(
    template_id: str, build_id: str, orch: Orchestrator = Depends(orchestrator),
    logsOffset: int = Query(default=0, ge=0), limit: int = Query(default=STATUS_PAGE, ge=1, le=1000),
) -> JSONResponse:
    rec = orch.builds.record(template_id, build_id)
    entries = rec.logs[logsOffset : logsOffset + limit]
    out: dict[str, Any] = {
        "templateID": rec.template_id, "buildID": rec.build_id, "status": rec.status,
        "logEntries": entries, "logs": [e["message"] for e in entries],
    }  # fmt: skip
    if rec.reason is not None:
        out["reason"] = rec.reason
    return JSONResponse(out)


@router.get("/templates/{template_id}/builds/{build_id}/logs")
async def build_logs(
    template_id: str, build_id: str, orch: Orchestrator = Depends(orchestrator),
    cursor: int | None = Query(None, ge=0), limit: int = Query(100, ge=1, le=1000),
    direction: Literal["forward", "backward"] = "forward", level: Literal["debug", "info", "warn", "error"] = "debug",
    source: Literal["temporary", "persistent"] | None = None,
) -> JSONResponse:
    """E2B's build log query: ``cursor`` is a time in milliseconds (from it on, or up to it going
    backward). A build's lines are kept with the build, so both sources read the same lines."""
    entries = orch.builds.record(template_id, build_id).logs
    wanted = set(LEVELS[LEVELS.index(level):])
    picked = [e for e in entries if e.get("level", "info") in wanted]
    if cursor is not None:
        at = dt.datetime.fromtimestamp(cursor / 1000, dt.UTC)
        picked = [e for e in picked if (_when(e) >= at if direction == "forward" else _when(e) <= at)]
    if direction == "backward":
        picked.reverse()
    return JSONResponse({"logs": picked[:limit]})


def _when(entry: dict[str, Any]) -> dt.datetime:
    return dt.datetime.fromisoformat(str(entry["timestamp"]).replace("Z", "+00:00"))


class AssignTagsBody(_Body):
    target: str = Field(min_length=1, max_length=200)
    tags: list[str] = Field(min_length=1, max_length=16)


class RemoveTagsBody(_Body):
    name: str = Field(min_length=1, max_length=200)
    tags: list[str] = Field(min_length=1, max_length=16)


@router.post("/templates/tags", status_code=201)
async def assign_tags(body: AssignTagsBody, request: Request, orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:
    tenancy.check_template_change(request, body.target)
    build_id, tags = orch.builds.assign_tags(body.target, body.tags)
    await orch.shared_templates.sync_rows(orch.shared_templates.family_named(body.target))
    return JSONResponse({"tags": tags, "buildID": build_id}, status_code=201)


@router.delete("/templates/tags", status_code=204)
async def remove_tags(body: RemoveTagsBody, request: Request, orch: Orchestrator = Depends(orchestrator)) -> Response:
    tenancy.check_template_change(request, body.name)
    family = orch.shared_templates.family_named(body.name)
    orch.builds.remove_tags(body.name, body.tags)
    await orch.shared_templates.sync_rows(family)
    return Response(status_code=204)


@router.get("/templates/{template_id}/tags")
async def list_tags(template_id: str, orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:
    return JSONResponse(orch.builds.tags_of(template_id))


# E2B's tag queries. A tag here names one build at a time: its one assignment is that build's.
@router.get("/templates/{template_id}/tags/count")
async def count_tags(template_id: str, orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:
    return JSONResponse({"total": len(orch.builds.tags_of(template_id))})


@router.get("/templates/{template_id}/tags/exists")
async def tag_exists(template_id: str, tag: str = Query(min_length=1, max_length=200),
                     orch: Orchestrator = Depends(orchestrator)) -> JSONResponse:
    tags = {t["tag"] for t in orch.builds.tags_of(template_id)}
    return JSONResponse({"exists": tag in tags, "normalizedTag": tag})


@router.get("/templates/{template_id}/tags/groups")
async def tag_groups(
    template_id: str, orch: Orchestrator = Depends(orchestrator),
    assignmentLimit: int = Query(6, ge=1, le=100), tagsLimit: int = Query(25, ge=1, le=100),  # noqa: N803 - E2B's names
    tagsCursor: str | None = Query(None, max_length=200), search: str | None = Query(None, max_length=200),  # noqa: N803
    sort: Literal["latest_asc", "latest_desc", "name_asc", "name_desc"] = "latest_desc",
) -> JSONResponse:
    tags = [t for t in orch.builds.tags_of(template_id) if not search or search in t["tag"]]
    key, reverse = ("tag", sort == "name_desc") if sort.startswith("name") else ("createdAt", sort == "latest_desc")
    tags.sort(key=lambda t: (t[key], t["tag"]), reverse=reverse)
    start = int(tagsCursor) if tagsCursor and tagsCursor.isdigit() else 0
    page = tags[start:start + tagsLimit]
    groups = [{"tag": t["tag"], "assignments": [_assignment(template_id, t)][:assignmentLimit], "hasMore": False}
              for t in page]  # fmt: skip
    more = start + tagsLimit < len(tags)
    return JSONResponse({"tags": groups, "nextCursor": str(start + tagsLimit) if more else None})


@router.get("/templates/{template_id}/tags/{tag}/assignments")
async def tag_assignments(template_id: str, tag: str, orch: Orchestrator = Depends(orchestrator),
                          cursor: str | None = Query(None, max_length=200),
                          limit: int = Query(50, ge=1, le=100)) -> JSONResponse:
    found = [t for t in orch.builds.tags_of(template_id) if t["tag"] == tag]
    if not found:
        raise NotFound(f"template '{template_id}' has no tag {tag}", template=template_id)
    data = [] if cursor else [_assignment(template_id, found[0])]
    return JSONResponse({"data": data, "nextCursor": None})


def _assignment(template_id: str, tag: dict[str, Any]) -> dict[str, Any]:
    """E2B's ``TemplateTagAssignment`` of a tag's current build (the assignment ID is stable per tag
    and build)."""
    assignment = uuid.uuid5(uuid.NAMESPACE_URL, f"aenv:{template_id}:{tag['tag']}:{tag['buildID']}")
    return {"assignmentID": str(assignment), "buildID": tag["buildID"], "assignedAt": tag["createdAt"],
            "buildCreatedAt": tag["createdAt"], "buildFinishedAt": tag["createdAt"]}

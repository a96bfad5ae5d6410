"""Template builds, the E2B way: the steps run in a sandbox of the server's own runtime, each step's
result is a snapshot kept by the cache key of everything up to it, and the result is a snapshot-backed
template like any other (forkable, pooled, startable by name or ID).

Flow of one build (``POST /v3/templates`` → uploads → ``POST /v2/templates/{id}/builds/{build}`` →
polling ``…/status``): the base comes from the catalog (``fromTemplate``) or through aenv's own OCI
client (``fromImage``: mirrors, insecure registries, the layer cache); the longest cached prefix of the
step chain is found and a build sandbox starts from it; the remaining steps run as their user with the
build's environment, a snapshot after every step that changes files; then the start command runs, the
ready command is waited for, and the final snapshot becomes the template. A failing step ends the build
in ``error`` with that step, its output and exit code, and registers nothing.

Step snapshots are internal snapshots behind hidden templates (``config.hidden``): a later build
starts from them, the snapshot GC keeps what a template points at, and listings do not show them.
Concurrent builds of one name share one build. Records live in ``<state>/builds/`` so a restart can
say that a build was cut short instead of forgetting it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from aenv.core.build_spec import (
    BuildSpec,
    BuildState,
    Step,
    chain_keys,
    copy_script,
    env_references,
    expand_env,
    final_key,
    first_forced,
    lookup_script,
)
from aenv.core.context import Context
from aenv.core.ids import new_id
from aenv.core.models import CreateRequest
from aenv.core.snapshots import SnapshotFlows
from aenv.core.table import LiveSandbox
from aenv.core.template_flows import TemplateFlows
from aenv.core.templates import DEFAULT_TAG, alias_for, family_of, split_tag
from aenv.errors import AenvError, Conflict, InvalidRequest, NotFound, TemplateNotFound
from aenv.kinds import SnapshotMode, TemplateKind
from aenv.mux import ByteStream
from aenv.runtime.envd_client import ENVD_PORT, EnvdError, run_command, upload
from aenv.store.sqlite import SnapshotRow, TemplateRow

log = logging.getLogger("aenv.core")

BUILD_TIMEOUT_S = 3600
READY_TIMEOUT_S = 300
MAX_LOG_ENTRIES = 20_000
LOG_TAIL = 40  # entries a failure's reason carries
CACHE_ENTRIES = 512  # cached step results kept (oldest dropped first)
TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class SandboxDoor(Protocol):
    """What a build needs of the orchestrator (passed in; no import of it here)."""

    async def create(self, req: CreateRequest) -> LiveSandbox: ...

    async def kill(self, sandbox_id: str) -> None: ...

    async def open_stream(self, sandbox_id: str, port: int) -> ByteStream: ...


class BuildNotFound(NotFound):
    def __init__(self, template_id: str, build_id: str) -> None:
        super().__init__(f"build '{build_id}' of template '{template_id}' not found", template=template_id)


@dataclass
class BuildRecord:
    template_id: str
    build_id: str
    alias: str
    tags: list[str] = field(default_factory=list)
    cpu_count: int | None = None
    memory_mb: int | None = None
    status: str = "waiting"  # waiting (requested) → building → ready | error
    spec_key: str | None = None
    logs: list[dict[str, Any]] = field(default_factory=list)
    reason: dict[str, Any] | None = None
    owner: str = ""  # the team that asked for it: the templates it makes are that team's

    def log(self, message: str, level: str = "info", step: str | None = None) -> None:
        entry: dict[str, Any] = {"timestamp": dt.datetime.now(dt.UTC).isoformat(), "level": level, "message": message}
        if step is not None:
            entry["step"] = step
        if len(self.logs) < MAX_LOG_ENTRIES:
            self.logs.append(entry)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class TemplateBuilds:
    def __init__(self, ctx: Context, door: SandboxDoor, snapshots: SnapshotFlows, templates: TemplateFlows) -> None:
        self.ctx = ctx
        self.door = door
        self.snapshots = snapshots
        self.template_flows = templates
        self.root = ctx.settings.state_dir / "builds"
        self.files_dir = self.root / "files"
        self.records_dir = self.root / "records"
        self.cache_file = self.root / "cache.json"
        self._records: dict[str, BuildRecord] = {}
        self._active: dict[str, BuildRecord] = {}  # alias → its build in progress
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.upload_secret = secrets.token_hex(16)  # signs upload links (they carry no API key)
        # (template ID, build ID, snapshot ID) -> published? A built template goes to the shared store
        self.publish: Callable[[str, str, str], Awaitable[bool]] | None = None

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """After recovery: a build a stopped server left in progress ended with it; its sandbox too."""
        for d in (self.files_dir, self.records_dir):
            d.mkdir(parents=True, exist_ok=True)
        for path in self.records_dir.glob("*.json"):
            with contextlib.suppress(OSError, ValueError, TypeError):
                rec = BuildRecord(**json.loads(path.read_text()))
                if rec.status in ("waiting", "building"):
                    rec.status = "error"
                    rec.reason = {"message": "the server stopped during the build; build again", "step": "base"}
                    self._save(rec)
                self._records[rec.build_id] = rec
        for sbx in self.ctx.table:
            if "aenv.build" in sbx.row.metadata:
                log.info("sandbox=%s: build sandbox of a build cut short; killing it", sbx.id)
                with contextlib.suppress(AenvError):
                    await self.door.kill(sbx.id)

    async def aclose(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        for task in list(self._tasks.values()):
            with contextlib.suppress(BaseException):
                await task

    # ---- the E2B calls --------------------------------------------------------------------------
    def request(self, name: str, tags: list[str], cpu_count: int | None, memory_mb: int | None,
                ids: tuple[str, str] | None = None, owner: str = "") -> BuildRecord:  # fmt: skip
        """``POST /v3/templates``: a build of ``name`` (``name:tag``; or the one in progress, shared), for
        the template of that name: every tag of one name has one template ID, as on E2B. ``ids``: the
        template and build IDs to use (a gateway replays one build on every node under the same IDs);
        a name whose template has another ID here is a Conflict."""
        plain, tag = split_tag(name)
        alias = alias_for(plain, tag)
        active = self._active.get(alias)
        named = self._rows_named(plain)
        if any(r.owner != owner for r in named) or (active is not None and active.owner != owner):
            # template names are one namespace per server: another team's name is not this team's to build
            raise Conflict(f"template name '{plain}' is taken by another team; pick another name", template=plain)
        if active is not None:
            if ids is not None and ids != (active.template_id, active.build_id):
                raise Conflict(f"another build of '{alias}' is in progress on this node", template=alias)
            return active
        for taken in dict.fromkeys((alias, plain)):
            existing = self.ctx.store.get_template(taken)
            if existing is not None and existing.alias == taken and not existing.config.get("built"):
                raise Conflict(f"template name '{taken}' belongs to a {existing.kind.value} template; pick another "
                               "name", template=taken)  # fmt: skip
        template_id = self._template_id_for(plain, ids[0] if ids else None)
        if ids is not None and template_id != ids[0]:
            raise Conflict(f"template '{plain}' has the ID {template_id} on this node, not {ids[0]}", template=plain)
        build_id = ids[1] if ids else str(uuid.uuid4())
        rec = BuildRecord(template_id, build_id, alias, list(tags), cpu_count, memory_mb, owner=owner)
        self._records[rec.build_id] = rec
        self._active[alias] = rec
        self._save(rec)
        return rec

    def _template_id_for(self, plain: str, new: str | None = None) -> str:
        """The ID of template ``plain``: its rows', else a build of another of its tags in progress, else
        ``new`` or a new one."""
        rows = self._rows_named(plain)
        if rows:
            return family_of(rows[0])
        building = (r.template_id for r in self._active.values() if split_tag(r.alias)[0] == plain)
        return next(building, None) or new or new_id()

    def _rows_named(self, name: str) -> list[TemplateRow]:
        """The built rows (one per tag) of the template ``name`` (its name or its ID; ``name:tag`` for the
        template that tag belongs to)."""
        if ":" in name:
            name = family_of(self.ctx.templates.resolve(name))
        return [r for r in self.ctx.templates.list_templates()
                if r.alias and r.config.get("built") and name in (split_tag(r.alias)[0], family_of(r))]

    def template_id_of(self, name: str) -> str:
        """``GET /templates/aliases/{name}`` for a name with tags but no ``default`` tag (E2B: the name
        exists once a build of any of its tags is ready)."""
        rows = self._rows_named(name)
        if not rows:
            raise TemplateNotFound(name)
        return family_of(rows[0])

    def file_present(self, files_hash: str, template_id: str | None = None) -> bool:
        """Whether the files are here already (``template_id``: one a build was asked for, else a 404)."""
        if template_id is not None and not any(r.template_id == template_id for r in self.records()):
            self.ctx.templates.resolve(template_id)  # files are uploaded for a template before it exists
        return self._file(files_hash).is_file()

    def upload_token(self, files_hash: str) -> str:
        """What an upload link for these files carries instead of an API key (an HMAC, per server run)."""
        return hmac.new(self.upload_secret.encode(), files_hash.encode(), hashlib.sha256).hexdigest()

    async def receive_file(self, files_hash: str, chunks: AsyncIterator[bytes], max_bytes: int) -> int:
        """Store an uploaded COPY source (a tar, maybe gzipped) under its hash; written aside, then
        renamed, so a cut upload leaves nothing under the name."""
        dest = self._file(files_hash)
        tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}")
        size = 0
        try:
            with tmp.open("wb") as fh:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > max_bytes:
                        raise InvalidRequest(f"upload larger than {max_bytes} bytes")
                    fh.write(chunk)
            os.rename(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        return size

    def trigger(self, template_id: str, build_id: str, spec: BuildSpec) -> None:
        """``POST /v2/templates/{id}/builds/{build}``: run it (a second trigger of the same build with
        the same steps joins it; with other steps it is refused)."""
        rec = self.record(template_id, build_id)
        key = json.dumps(_spec_json(spec), sort_keys=True)
        if rec.status != "waiting":
            if rec.spec_key == key:
                return
            raise Conflict(f"build '{build_id}' of '{rec.alias}' already runs with other steps")
        if spec.from_template and self.ctx.store.get_template(spec.from_template) is None:
            raise NotFound(f"template '{spec.from_template}' not found", template=spec.from_template)
        rec.spec_key, rec.status = key, "building"
        self._save(rec)
        task = asyncio.create_task(self._run(rec, spec), name=f"aenv-build-{build_id}")
        self._tasks[build_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(build_id, None))

    def records(self) -> list[BuildRecord]:
        return list(self._records.values())

    def record(self, template_id: str, build_id: str) -> BuildRecord:
        rec = self._records.get(build_id)
        if rec is None or rec.template_id != template_id:
            raise BuildNotFound(template_id, build_id)
        return rec

    # ---- one build ------------------------------------------------------------------------------
    async def _run(self, rec: BuildRecord, spec: BuildSpec) -> None:
        sandbox_id: str | None = None
        step = "base"
        try:
            base = await self._base(rec, spec)
            # the team is part of the key: one team's cached steps (what its RUN lines fetched) are not another's
            shape = f"{rec.cpu_count}:{rec.memory_mb}:{self.ctx.runtime.name}:{rec.owner}"
            keys = chain_keys(f"{base.id}:{base.config.get('snapshot', '')}:{base.rootfs}:{shape}", spec)
            fkey = final_key(keys[-1], spec)
            forced = first_forced(spec)
            cache = self._cache()
            if forced is None and self._usable(cache.get(fkey)):
                rec.log("every step is cached: the template is ready as built before", step="finalize")
                self._register(rec, base, str(cache[fkey]["snapshot"]), BuildState.from_json(cache[fkey]["state"]), spec)
                return await self._publish_and_finish(rec, str(cache[fkey]["snapshot"]))
            first = self._resume_point(keys, cache, forced)
            entry = cache.get(keys[first]) if first else None
            state = BuildState.from_json(entry["state"]) if entry else BuildState(workdir=base.config.get("workdir"))
            start_from = str(entry["snapshot"]) if entry else base.id
            if first:
                rec.log(f"steps 1-{first} cached", step=str(first))
            sandbox_id = (await self.door.create(CreateRequest(
                template=start_from, timeout=min(BUILD_TIMEOUT_S, self.ctx.settings.max_timeout),
                metadata={"aenv.build": rec.build_id}, secure=False, cpu_count=rec.cpu_count,
                memory_mb=rec.memory_mb, owner=rec.owner,
            ))).id  # fmt: skip
            for i, s in enumerate(spec.steps[first:], first + 1):
                step = str(i)
                rec.log(f"step {i}/{len(spec.steps)}: {s.describe()}", step=step)
                state = state.after(await self._apply(rec, sandbox_id, s, state, step))
                snap = await self._checkpoint(sandbox_id, base, state, SnapshotMode.FILESYSTEM) if s.changes_files \
                    else (str(cache[keys[i - 1]]["snapshot"]) if keys[i - 1] in cache and i > 1 else None)
                if snap is not None:
                    cache[keys[i]] = {"snapshot": snap, "state": state.to_json()}
                    self._save_cache(cache)
            step = "finalize"
            await self._start_and_wait(rec, sandbox_id, spec, state)
            final = await self._final_checkpoint(rec, sandbox_id, base, state, spec)
            cache[fkey] = {"snapshot": final, "state": state.to_json()}
            self._save_cache(cache)
            self._register(rec, base, final, state, spec)
            await self._publish_and_finish(rec, final)
        except BuildFailed as exc:
            self._fail(rec, str(exc), step)
        except asyncio.CancelledError:
            self._fail(rec, "the server stopped during the build; build again", step)
            raise
        except Exception as exc:  # noqa: BLE001 - any failure ends the build, reported, never half-registered
            self._fail(rec, f"{exc}" if isinstance(exc, AenvError) else f"{type(exc).__name__}: {exc}", step)
        finally:
            if sandbox_id is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.door.kill(sandbox_id))

    async def _base(self, rec: BuildRecord, spec: BuildSpec) -> TemplateRow:
        if spec.from_template is not None:
            row = self.ctx.templates.resolve(spec.from_template)
            if not (row.public or row.owner in ("", rec.owner)):
                raise TemplateNotFound(spec.from_template)  # another team's private template: as if none
            return row
        assert spec.from_image is not None
        rec.log(f"pulling {spec.from_image}", step="base")
        row, summary = await self.template_flows.pull(spec.from_image, hidden=True)
        rec.log(summary, step="base")
        return row

    def _resume_point(self, keys: list[str], cache: dict[str, Any], forced: int | None) -> int:
        """The last step whose result is cached and may be used (0: start from the base)."""
        for i in range(len(keys) - 1, 0, -1):
            if forced is not None and i >= forced:
                continue
            if self._usable(cache.get(keys[i])):
                return i
        return 0

    def _usable(self, entry: Any) -> bool:
        if not isinstance(entry, dict) or not isinstance(entry.get("snapshot"), str):
            return False
        row = self.ctx.store.get_snapshot(entry["snapshot"])
        return row is not None and row.state == "ready" and Path(row.dir).is_dir() \
            and self.ctx.store.get_template(row.id) is not None

    async def _apply(self, rec: BuildRecord, sandbox_id: str, step: Step, state: BuildState, label: str) -> Step:
        """Runs the step; returns it as the state takes it (an ENV step with its values expanded)."""
        if step.type == "ENV" and (names := env_references(step)):
            return expand_env(step, await self._lookup(sandbox_id, names, state, label, step.describe()))
        if step.type == "RUN":
            user = step.args[1] if len(step.args) > 1 and step.args[1] else state.user
            await self._sh(rec, sandbox_id, step.args[0], user, state, label, what=step.describe())
        elif step.type == "COPY":
            assert step.files_hash is not None
            src = self._file(step.files_hash)
            if not src.is_file():
                raise BuildFailed(f"the files of step {label} were never uploaded (hash {step.files_hash})")
            archive = f"/tmp/.aenv-copy-{step.files_hash[:16]}.tar"
            stream = await self.door.open_stream(sandbox_id, ENVD_PORT)
            await upload(stream, archive, await asyncio.to_thread(src.read_bytes))
            await self._sh(rec, sandbox_id, copy_script(step, archive), "root", state, label, what=step.describe())
        elif step.type == "WORKDIR":
            await self._sh(rec, sandbox_id, f"mkdir -p '{step.args[0]}'", "root", state, label, what=step.describe())
        return step

    async def _lookup(self, sandbox_id: str, names: list[str], state: BuildState, label: str, what: str) -> dict[str, str]:
        """The values ``names`` have for a step's shell in the build sandbox (root, with the variables
        set so far over the sandbox's own environment), so ``ENV PATH=/opt/bin:$PATH`` extends PATH."""
        stream = await self.door.open_stream(sandbox_id, ENVD_PORT)
        try:
            res = await run_command(stream, lookup_script(names), user="root", envs=state.env)
        except EnvdError as exc:
            raise BuildFailed(f"step {label} ({what}): the sandbox did not answer: {exc}") from exc
        if res.exit_code != 0:
            raise BuildFailed(f"step {label} ({what}): expanding {', '.join(names)} failed: "
                              f"{(res.stderr.decode(errors='replace') or res.error).strip()[:300]}")
        return dict(zip(names, res.stdout.decode(errors="replace").split("\0"), strict=False))

    async def _sh(self, rec: BuildRecord, sandbox_id: str, cmd: str, user: str, state: BuildState, label: str,
                  *, what: str, quiet: bool = False) -> int:
        stream = await self.door.open_stream(sandbox_id, ENVD_PORT)
        try:
            res = await run_command(stream, cmd, user=user, envs=state.env, cwd=state.workdir)
        except EnvdError as exc:
            raise BuildFailed(f"step {label} ({what}): the sandbox did not answer: {exc}") from exc
        if not quiet:
            for line in (res.stdout + res.stderr).decode(errors="replace").splitlines():
                rec.log(line, step=label)
        if res.exit_code is None:
            # E2B's words for a command envd refused, which the SDK's own tests look for
            raise BuildFailed(f"step {label} ({what}): failed to run command '{cmd}': command failed: "
                              f"{res.error or 'no exit status'}")
        if res.exit_code != 0 and not quiet:
            raise BuildFailed(f"step {label} ({what}) failed with exit code {res.exit_code}")
        return res.exit_code

    async def _start_and_wait(self, rec: BuildRecord, sandbox_id: str, spec: BuildSpec, state: BuildState) -> None:
        if spec.start_cmd:
            rec.log(f"start command: {spec.start_cmd}", step="finalize")
            start = f"nohup /bin/sh -c {json.dumps(spec.start_cmd)} >/tmp/.aenv-start.log 2>&1 &"
            await self._sh(rec, sandbox_id, start, state.user, state, "finalize", what="start command")
        if spec.ready_cmd:
            rec.log(f"waiting for: {spec.ready_cmd}", step="finalize")
            deadline = asyncio.get_running_loop().time() + READY_TIMEOUT_S
            while await self._sh(rec, sandbox_id, spec.ready_cmd, state.user, state, "finalize",
                                 what="ready command", quiet=True) != 0:
                if asyncio.get_running_loop().time() > deadline:
                    raise BuildFailed(f"the ready command did not succeed within {READY_TIMEOUT_S} s")
                await asyncio.sleep(0.5)

    async def _final_checkpoint(self, rec: BuildRecord, sandbox_id: str, base: TemplateRow, state: BuildState,
                                spec: BuildSpec) -> str:
        """The template's own snapshot, with its processes where the runtime can (a start command's
        processes are the template's; without one, a process image only makes later starts faster).
        Without a start command a process image that cannot be taken is said in the build's log and
        the template keeps its files, as every step's snapshot does; with one, the build fails."""
        mode = await self.snapshots.runtime.fork_mode(sandbox_id)
        try:
            return await self._checkpoint(sandbox_id, base, state, mode)
        except AenvError as exc:
            if mode is SnapshotMode.FILESYSTEM or spec.start_cmd:
                raise
            rec.log(f"the sandbox's processes could not be saved ({exc.message}); the template keeps its files "
                    "and its sandboxes start fresh", step="finalize", level="warn")
            return await self._checkpoint(sandbox_id, base, state, SnapshotMode.FILESYSTEM)

    async def _checkpoint(self, sandbox_id: str, base: TemplateRow, state: BuildState, mode: SnapshotMode) -> str:
        """An internal snapshot of the build sandbox behind a hidden template (a later build, or the
        template itself, starts from it by its ID)."""
        row = await self.snapshots.checkpoint(sandbox_id, mode)
        self._hidden_template(row, base, state)
        return row.id

    def _hidden_template(self, snap: SnapshotRow, base: TemplateRow, state: BuildState) -> None:
        self.ctx.templates.register(
            alias=None, kind=TemplateKind.SNAPSHOT, rootfs=Path(base.rootfs), lowers=[Path(p) for p in base.lowers],
            config={**base.config, "snapshot": snap.id, "hidden": True, "user": _sandbox_user(base, state),
                    "workdir": state.workdir},
            source=f"build step of {base.alias or base.id}", template_id=snap.id, cpu_count=base.cpu_count,
            memory_mb=base.memory_mb, owner=snap.owner,
        )  # fmt: skip

    def _register(self, rec: BuildRecord, base: TemplateRow, snapshot_id: str, state: BuildState,
                  spec: BuildSpec) -> None:
        config = {**base.config, "snapshot": snapshot_id, "built": True, "build_id": rec.build_id, "family": rec.template_id,
                  "user": _sandbox_user(base, state), "workdir": state.workdir,
                  "start_cmd": spec.start_cmd, "ready_cmd": spec.ready_cmd,
                  # the start command runs as the steps did at its point (Docker's and E2B's rule)
                  "start_user": state.user if spec.start_cmd else None,
                  "start_cwd": state.workdir if spec.start_cmd else None}
        config.pop("hidden", None)
        config.pop("tag_of", None)
        # one row per tag: the build's own (``name`` for ``default``) and each extra tag, all of one template
        main = self.ctx.templates.register(
            alias=rec.alias, kind=TemplateKind.SNAPSHOT, rootfs=Path(base.rootfs), lowers=[Path(p) for p in base.lowers],
            config=config, source=f"build {rec.build_id}",
            template_id=self._row_id(rec.template_id, rec.alias, split_tag(rec.alias)[1]),
            cpu_count=rec.cpu_count or base.cpu_count, memory_mb=rec.memory_mb or base.memory_mb, owner=rec.owner,
        )  # fmt: skip
        for tag in rec.tags:
            self._tag(main, tag)

    # ---- tags: more names for one build ---------------------------------------------------------
    def assign_tags(self, target: str, tags: list[str]) -> tuple[str, list[str]]:
        """``POST /templates/tags``: ``target`` (``name`` or ``name:tag``) gets the extra ``tags``."""
        row = self.ctx.templates.resolve(target)
        if not row.config.get("built"):
            raise InvalidRequest(f"'{target}' is not a built template: only builds have tags")
        for tag in tags:
            self._tag(row, tag)
        return str(row.config.get("build_id", "")), list(tags)

    def remove_tags(self, name: str, tags: list[str]) -> None:
        """``DELETE /templates/tags``: the builds stay where another tag names them (or a sandbox runs)."""
        rows = {split_tag(str(r.alias))[1]: r for r in self._rows_named(name)}
        missing = [t for t in tags if t not in rows]
        if missing:
            raise NotFound(f"template '{name}' has no tag {', '.join(missing)}", template=name)
        for tag in tags:
            self.ctx.store.delete_template(rows[tag].id)

    def tags_of(self, template: str) -> list[dict[str, Any]]:
        """``GET /templates/{name or ID}/tags``: every tag of the template and the build it names."""
        rows = self._rows_named(template)
        if not rows:
            self.ctx.templates.resolve(template)  # a template that is not built has no tags; no template: 404
        return [
            {"tag": split_tag(str(t.alias))[1], "buildID": str(t.config.get("build_id", "")),
             "createdAt": dt.datetime.fromtimestamp(t.created_at, dt.UTC).isoformat()}
            for t in rows
        ]  # fmt: skip

    def _tag(self, row: TemplateRow, tag: str) -> None:
        if not TAG.match(tag):
            raise InvalidRequest(f"bad tag {tag!r}: letters, digits, '.', '_' and '-'")
        family = family_of(row)
        alias = alias_for(split_tag(row.alias or family)[0], tag)
        config = {**row.config, "family": family}
        config.pop("tag_of", None)
        self.ctx.templates.register(
            alias=alias, kind=TemplateKind.SNAPSHOT, rootfs=Path(row.rootfs), lowers=[Path(p) for p in row.lowers],
            config=config, source=row.source, template_id=self._row_id(family, alias, tag),
            cpu_count=row.cpu_count, memory_mb=row.memory_mb, owner=row.owner,
        )  # fmt: skip

    def _row_id(self, family: str, alias: str, tag: str) -> str:
        """The row of one tag keeps its ID across rebuilds: the template's own ID for ``default`` (so
        ``Sandbox.create(template_id)`` is ``name:default``, as on E2B), derived from it for other tags."""
        existing = self.ctx.store.get_template(alias)
        if existing is not None and existing.alias == alias and existing.config.get("built"):
            return existing.id
        derived = f"{family}-{hashlib.sha256(tag.encode()).hexdigest()[:10]}"
        taken = self.ctx.store.get_template(family)
        return family if tag == DEFAULT_TAG and (taken is None or taken.alias == alias) else derived

    async def _publish_and_finish(self, rec: BuildRecord, snapshot_id: str) -> None:
        """Ready once published where the nodes share a store (``template_share.py``): a node asked for
        it next finds it there."""
        if self.publish is not None and await self.publish(rec.template_id, rec.build_id, snapshot_id):
            rec.log("published to the shared store: every node starts it", step="finalize")
        self._finish(rec)

    def _finish(self, rec: BuildRecord) -> None:
        rec.status = "ready"
        rec.log(f"template {rec.alias} ({rec.template_id}) is ready", step="finalize")
        self._active.pop(rec.alias, None)
        self._save(rec)
        log.info("template=%s build=%s ready", rec.alias, rec.build_id)

    def _fail(self, rec: BuildRecord, message: str, step: str) -> None:
        rec.log(message, level="error", step=step)
        rec.status = "error"
        rec.reason = {"message": message, "step": step, "logEntries": rec.logs[-LOG_TAIL:]}
        self._active.pop(rec.alias, None)
        self._save(rec)
        log.warning("template=%s build=%s failed at step %s: %s", rec.alias, rec.build_id, step, message)

    # ---- files on disk --------------------------------------------------------------------------
    def _file(self, files_hash: str) -> Path:
        return self.files_dir / f"{files_hash}.tar"

    def _save(self, rec: BuildRecord) -> None:
        self.records_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.records_dir / f".{rec.build_id}.json.tmp"
        tmp.write_text(json.dumps(rec.to_json()))
        os.rename(tmp, self.records_dir / f"{rec.build_id}.json")

    def _cache(self) -> dict[str, Any]:
        try:
            raw = json.loads(self.cache_file.read_text())
        except (OSError, ValueError):
            return {}
        return raw if isinstance(raw, dict) else {}

    def _save_cache(self, cache: dict[str, Any]) -> None:
        """Write the cache index, first dropping the oldest entries past ``CACHE_ENTRIES``: a step
        snapshot no entry and no template names any more loses its hidden template, and the snapshot
        GC takes it."""
        evicted = list(cache)[: max(0, len(cache) - CACHE_ENTRIES)]
        for key in evicted:
            cache.pop(key)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.cache_file.with_name(f".cache.{secrets.token_hex(4)}")
        tmp.write_text(json.dumps(cache))
        os.rename(tmp, self.cache_file)
        if evicted:
            self._drop_unreferenced_steps(cache)

    def _drop_unreferenced_steps(self, cache: dict[str, Any]) -> None:
        rows = self.ctx.store.list_templates()
        kept = {e.get("snapshot") for e in cache.values() if isinstance(e, dict)}
        kept |= {r.config.get("snapshot") for r in rows if not r.config.get("hidden")}
        for row in rows:
            if row.config.get("hidden") and row.kind is TemplateKind.SNAPSHOT and row.id not in kept:
                self.ctx.store.delete_template(row.id)
        self.snapshots.collect_garbage()


class BuildFailed(Exception):
    """A step (or the start/ready command) failed: the build ends with this message."""


def _sandbox_user(base: TemplateRow, state: BuildState) -> str:
    """The built template's default user: the last USER step's, else the base's (``user``)."""
    return state.default_user or str(base.config.get("user") or "user")


def _spec_json(spec: BuildSpec) -> dict[str, Any]:
    return {
        "fromImage": spec.from_image, "fromTemplate": spec.from_template, "force": spec.force,
        "startCmd": spec.start_cmd, "readyCmd": spec.ready_cmd,
        "steps": [[s.type, list(s.args), s.files_hash, s.force] for s in spec.steps],
    }  # fmt: skip

"""The template's own snapshot at the end of a build: with its processes where the runtime can; a
process image that cannot be taken (a CRIU dump that fails) leaves a build without a start command
with its files, said in the build's log, rather than failing the build."""

from __future__ import annotations

import asyncio

from aenv.core.build_spec import BuildSpec
from aenv.core.orchestrator import Orchestrator
from tests.fixtures.runtime import FakeRuntime


async def _build(o: Orchestrator, name: str) -> tuple[str, list[str]]:
    rec = o.builds.request(name, [], None, None)
    o.builds.trigger(rec.template_id, rec.build_id, BuildSpec(from_template="base"))
    for _ in range(500):
        if rec.status in ("ready", "error"):
            break
        await asyncio.sleep(0.01)
    return rec.status, [str(e["message"]) for e in rec.logs]


def _template_mode(o: Orchestrator, name: str) -> str:
    snapshot_id = str(o.get_template(name).config["snapshot"])
    return str(o.get_snapshot(snapshot_id).mode)


async def test_the_template_keeps_its_processes_where_the_runtime_can(orch: Orchestrator) -> None:
    status, _ = await _build(orch, "full")
    assert status == "ready" and _template_mode(orch, "full") == "full"


async def test_a_process_image_that_fails_leaves_the_files_and_says_so(orch: Orchestrator) -> None:
    runtime = orch.runtime
    assert isinstance(runtime, FakeRuntime)
    runtime.fail_full_snapshot = True
    status, logs = await _build(orch, "files")
    assert status == "ready", logs
    assert _template_mode(orch, "files") == "filesystem"
    assert any("could not be saved (criu dump failed: exit 1)" in m for m in logs), logs

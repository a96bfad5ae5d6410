"""A build under IDs a gateway chose (``X-Aenv-Build-Ids``): a new template takes them; a name whose
template has another ID here, or another build of it in progress, is a Conflict."""

from __future__ import annotations

import asyncio

import pytest

from aenv.core.build_spec import BuildSpec
from aenv.core.orchestrator import Orchestrator
from aenv.errors import Conflict


async def test_a_new_template_takes_the_ids_it_is_given(orch: Orchestrator) -> None:
    rec = orch.builds.request("given", [], None, None, ("tplgiven1", "build-1"))
    assert (rec.template_id, rec.build_id) == ("tplgiven1", "build-1")
    assert orch.builds.request("given", [], None, None, ("tplgiven1", "build-1")) is rec  # the same call again
    with pytest.raises(Conflict, match="in progress"):
        orch.builds.request("given", [], None, None, ("tplgiven1", "build-2"))
    orch.builds.trigger(rec.template_id, rec.build_id, BuildSpec(from_template="base"))
    for _ in range(500):
        if rec.status in ("ready", "error"):
            break
        await asyncio.sleep(0.01)
    assert rec.status == "ready", rec.logs
    with pytest.raises(Conflict, match="has the ID tplgiven1 on this node, not other"):
        orch.builds.request("given", [], None, None, ("other", "build-3"))
    again = orch.builds.request("given", [], None, None, ("tplgiven1", "build-4"))
    assert again.template_id == "tplgiven1"

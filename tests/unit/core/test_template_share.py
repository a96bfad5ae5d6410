"""Built templates through a shared store, over the fake runtime (named ns here): one node publishes a
built template, another fetches it on first use under the same IDs and names (its snapshot internal),
a rebuild on a third node keeps the template's ID, and a delete on any node takes it out of the store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.core.models import CreateRequest
from aenv.core.node_facts import placement_facts
from aenv.core.orchestrator import Orchestrator
from aenv.core.template_share import row_entry, shares_templates
from aenv.core.templates import TemplateCatalog
from aenv.errors import TemplateNotFound
from aenv.kinds import SnapshotMode, TemplateKind
from aenv.snapshots.repository import repository_from_settings
from aenv.store.sqlite import Store
from tests.fixtures.runtime import FakeRuntime


@pytest.fixture
async def nodes(tmp_path: Path) -> AsyncIterator[list[Orchestrator]]:
    (tmp_path / "rootfs").mkdir()
    async with AsyncExitStack() as stack:
        out = []
        for name in ("a", "b", "c"):
            settings = Settings(state_dir=tmp_path / name, cache_dir=tmp_path / f"cache-{name}", reaper_interval=3600,
                                max_timeout=3600, snapshot_store=f"file://{tmp_path / 'shared'}")  # fmt: skip
            settings.state_dir.mkdir(parents=True)
            store = Store(settings.db_path)
            stack.callback(store.close)
            catalog = TemplateCatalog(settings, store)
            catalog.register(alias="base", kind=TemplateKind.BOOTSTRAP, rootfs=tmp_path / "rootfs", template_id="base")
            runtime = FakeRuntime()
            runtime.name = "ns"  # type: ignore[misc]  # shared templates are the ns runtime's
            o = Orchestrator(settings, store, runtime, catalog)
            o.attach_repository(repository_from_settings(settings))
            await o.start()
            stack.push_async_callback(o.close)
            out.append(o)
        yield out


async def _built_on(a: Orchestrator) -> str:
    """A built template ``tpl`` (ID ``fam1``, build ``b1``, tag ``v2`` too) on node ``a``: its snapshot ID."""
    sbx = await a.create(CreateRequest(template="base", timeout=600))
    snap = await a.snapshots.checkpoint(sbx.id, SnapshotMode.FILESYSTEM)
    for alias, row_id in (("tpl", "fam1"), ("tpl:v2", "fam1-v2")):
        a.templates.register(alias=alias, kind=TemplateKind.SNAPSHOT, rootfs=Path(a.templates.resolve("base").rootfs),
                             config={"snapshot": snap.id, "built": True, "family": "fam1", "build_id": "b1",
                                     "lazy_file": "/here/only"}, template_id=row_id, source="build b1")  # fmt: skip
    await a.kill(sbx.id)  # (its snapshot stays: a template points at it)
    return snap.id


async def test_built_once_fetched_on_first_use_and_deleted_everywhere(nodes: list[Orchestrator]) -> None:
    a, b, c = nodes
    snap = await _built_on(a)
    assert await a.shared_templates.publish("fam1", "b1", snap)
    with pytest.raises(TemplateNotFound):
        b.get_template("tpl")  # not here until something asks for it
    sbx = await b.create(CreateRequest(template="tpl:v2", timeout=600))  # first use: fetched
    assert b.get(sbx.id).row.template_id == "fam1-v2"
    assert {r.id for r in b.shared_templates.rows_of("fam1")} == {"fam1", "fam1-v2"}
    row = b.get_template("tpl")
    assert row.id == "fam1" and row.config["build_id"] == "b1" and "lazy_file" not in row.config
    fetched = b.store.get_snapshot(snap)
    assert fetched is not None and fetched.internal and fetched.published and Path(fetched.dir, "state").is_file()
    assert {"fam1", "tpl", "tpl:v2"} <= set(placement_facts(b.runtime, b.templates)["held"])
    await b.kill(sbx.id)
    assert c.builds.request("other", [], None, None).template_id != "fam1"
    assert await c.shared_templates.fetch("tpl")  # what a build request does first: a rebuild keeps the ID
    assert c.builds.request("tpl", [], None, None).template_id == "fam1"
    await c.delete_template("tpl:v2")  # the tag's row leaves the store, the rest stays
    await c.delete_template("tpl")  # and then the template
    await a.delete_template("tpl")  # the builder's own copy: deleted there (the store has it no more)
    with pytest.raises(TemplateNotFound):
        await c.delete_template("tpl")
    with pytest.raises(TemplateNotFound):
        await c.create(CreateRequest(template="tpl", timeout=600))
    shared = Path(str(a.settings.snapshot_store).removeprefix("file://"))
    assert not list((shared / "templates").glob("*")) and not list((shared / "manifests").glob("*"))
    await b.delete_template("fam1")  # the copies are deleted where they are, row by row as without a store
    assert [r.id for r in b.shared_templates.rows_of("fam1")] == ["fam1-v2"]


def test_what_is_shared_and_what_stays_on_the_host(tmp_path: Path) -> None:
    assert shares_templates(Settings(state_dir=tmp_path, snapshot_store="s3://b"), "ns")
    assert not shares_templates(Settings(state_dir=tmp_path, snapshot_store="s3://b"), "vm")
    assert not shares_templates(Settings(state_dir=tmp_path), "ns")  # the default store is this node's own
    assert not shares_templates(Settings(state_dir=tmp_path, snapshot_store=""), "ns")
    store = Store(tmp_path / "db.sqlite")
    try:
        row = TemplateCatalog(Settings(state_dir=tmp_path), store).register(
            alias="t", kind=TemplateKind.SNAPSHOT, rootfs=tmp_path, config={"built": True, "lazy_file": "/x"},
            template_id="t1")  # fmt: skip
    finally:
        store.close()
    entry = row_entry(row)
    assert entry["id"] == "t1" and entry["alias"] == "t" and entry["config"] == {"built": True}


async def test_a_node_holding_a_build_starts_the_rebuild_the_store_names(nodes: list[Orchestrator]) -> None:
    """A rebuild runs on one node; a node that held the previous build asks the store at its next create
    (at most every ``template_recheck_s``, 5 s by default) and starts the new build."""
    a, b, _ = nodes

    async def rebuild(build_id: str) -> None:
        sbx = await a.create(CreateRequest(template="base", timeout=600))
        snap = await a.snapshots.checkpoint(sbx.id, SnapshotMode.FILESYSTEM)
        a.templates.register(alias="tpl", kind=TemplateKind.SNAPSHOT, rootfs=Path(a.templates.resolve("base").rootfs),
                             config={"snapshot": snap.id, "built": True, "family": "fam1", "build_id": build_id},
                             template_id="fam1", source=f"build {build_id}")  # fmt: skip
        await a.kill(sbx.id)
        assert await a.shared_templates.publish("fam1", build_id, snap.id)

    async def started_build() -> str:
        sbx = await b.create(CreateRequest(template="tpl", timeout=600))
        await b.kill(sbx.id)
        return str(b.get_template("tpl").config["build_id"])

    await rebuild("b1")
    assert await started_build() == "b1"  # fetched on first use
    await rebuild("b2")
    assert await started_build() == "b2"  # held b1: the store was asked, b2 fetched
    await rebuild("b3")
    assert await started_build() == "b2"  # asked again only once template_recheck_s has passed
    b.shared_templates._checked.clear()
    assert await started_build() == "b3"

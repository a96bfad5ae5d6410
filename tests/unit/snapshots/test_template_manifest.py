"""Built templates in the snapshot repository: the template manifest's shape and checks, and its
publish / find by any name / delete round trip on a local object store."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from aenv.snapshots.manifest import Manifest, ManifestError
from aenv.snapshots.publish import materialize_files_elsewhere, publish_snapshot
from aenv.snapshots.repository import SnapshotRepository, make_store
from aenv.snapshots.templates import (
    TemplateManifest,
    delete_template,
    find_template,
    name_key,
    put_template,
    template_key,
)


@pytest.fixture
def repo(tmp_path: Path) -> SnapshotRepository:
    return SnapshotRepository(make_store(f"file://{tmp_path / 'store'}"), tmp_path / "scratch")


def _manifest(snapshot: str = "snap1") -> TemplateManifest:
    rows = [{"id": "t1", "alias": "my/tpl", "config": {"built": True, "family": "t1", "build_id": "b1"}, "cpu_count": 1,
             "memory_mb": 512, "source": "build b1", "public": False},
            {"id": "t1-abc", "alias": "my/tpl:v2", "config": {"built": True, "family": "t1"}, "cpu_count": 1,
             "memory_mb": 512, "source": "build b1", "public": False}]  # fmt: skip
    return TemplateManifest(template_id="t1", build_id="b1", snapshot_id=snapshot, runtime="ns", owner="team-a",
                            base={"id": "base", "alias": "base"}, rows=rows, created_at=1.0)  # fmt: skip


def test_the_manifest_round_trips_and_names_every_way_to_ask_for_it() -> None:
    m = _manifest()
    assert TemplateManifest.from_bytes(m.to_bytes()) == m
    lazy = replace(m, lazy={"digest": "sha256:" + "a" * 64, "chunks": 3, "stored": 100})
    assert TemplateManifest.from_bytes(lazy.to_bytes()) == lazy and m.lazy == {}
    assert m.names() == ["t1", "my/tpl", "t1-abc", "my/tpl:v2"]
    assert [r["id"] for r in m.without_row("t1-abc").rows] == ["t1"] and len(m.rows) == 2
    assert template_key("t1") == "templates/t1.json"
    assert name_key("my/tpl").startswith("template-names/") and "/" not in name_key("my/tpl")[len("template-names/"):]
    with pytest.raises(ValueError):
        template_key("../x")


@pytest.mark.parametrize("raw", [
    b"nope", b'{"magic": "aenv-snapshot"}', b'{"magic": "aenv-template", "version": 9}',
    b'{"magic": "aenv-template", "version": 1, "template_id": "t1"}',
    _manifest().to_bytes().replace(b'"snapshot_id":"snap1"', b'"snapshot_id":"../etc"'),
    _manifest().to_bytes().replace(b'"id":"t1-abc"', b'"id":"a/b"'),
])  # fmt: skip
def test_a_bad_manifest_is_refused(raw: bytes) -> None:
    with pytest.raises(ManifestError):
        TemplateManifest.from_bytes(raw)


async def test_publish_find_by_any_name_and_delete(repo: SnapshotRepository, tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    (upper / "opt").mkdir(parents=True)
    (upper / "opt" / "b").write_text("built")
    layer = await repo.put_layer("upper", upper)
    await repo.put_manifest(Manifest(snapshot_id="snap1", mode="filesystem", runtime="ns", template_id="base",
                                     layers=[layer]))  # fmt: skip
    await put_template(repo, _manifest())
    for name in ("t1", "my/tpl", "my/tpl:v2", "my/tpl:default", "t1-abc"):
        found = await find_template(repo, name)
        assert found is not None and found.template_id == "t1", name
    assert await find_template(repo, "other") is None and await find_template(repo, "my") is None
    await put_template(repo, _manifest().without_row("t1-abc"))  # a tag's row deleted: the rest stays
    assert (await find_template(repo, "my/tpl")) is not None and await find_template(repo, "t1-abc") is None
    found = await find_template(repo, "t1")
    assert found is not None
    await delete_template(repo, found)
    assert await find_template(repo, "t1") is None and await find_template(repo, "my/tpl") is None
    assert await repo.find_manifest("snap1") is None and not await repo.layer_exists(layer.digest)
    store = tmp_path / "store"
    assert not list((store / "templates").glob("*")) and not list((store / "template-names").glob("*"))


async def test_a_lazy_node_fetches_only_what_is_not_in_the_tree(repo: SnapshotRepository, tmp_path: Path) -> None:
    """A node reading the template's tree from its lazy artifact downloads the process image alone: the
    snapshot's upper is an empty dir, its stack is not fetched, and the record rests on the lazy root."""
    snap, parent = tmp_path / "snap", tmp_path / "parent-upper"
    (snap / "upper" / "opt").mkdir(parents=True)
    (snap / "upper" / "opt" / "b").write_text("built")
    (snap / "criu").mkdir()
    (snap / "criu" / "pages.img").write_bytes(b"p" * 100)
    parent.mkdir()
    (parent / "step").write_text("a step")
    result = {"layers": ["upper", "criu"], "stack": [str(parent)], "base_lowers": ["/base"], "data": {}}
    m = await publish_snapshot(repo, snapshot_id="snap1", directory=snap, mode="full", runtime="ns",
                               template_id="base", result=result)  # fmt: skip
    dest = tmp_path / "fetched"
    record = await materialize_files_elsewhere(repo, m, dest, "/lazy/root")
    assert record["stack"] == [] and record["base_lowers"] == ["/lazy/root"] and record["layers"] == ["upper", "criu"]
    assert (dest / "criu" / "pages.img").read_bytes() == b"p" * 100
    assert (dest / "upper").is_dir() and not list((dest / "upper").iterdir()) and not (dest / "stack").exists()

"""The snapshot repository against a real S3 server (SeaweedFS ``weed mini`` on 127.0.0.1).

Same contract as on a local directory: identical bytes back, content addressing, digest checks,
delete frees only unreferenced layers; plus what only S3 shows: keys are required, a prefix isolates.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import obstore
import pytest

from aenv.snapshots.manifest import Manifest, ManifestError
from aenv.snapshots.publish import materialize, publish_snapshot
from aenv.snapshots.repository import SnapshotRepository, layer_key, make_store
from tests.fixtures.seaweedfs import SeaweedFS, seaweedfs, unique_prefix  # noqa: F401


@pytest.fixture
def repo(seaweedfs: SeaweedFS, tmp_path: Path) -> SnapshotRepository:  # noqa: F811
    return SnapshotRepository(seaweedfs.store(unique_prefix("unit")), tmp_path / "scratch")


def _tree(root: Path, content: str) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "f.txt").write_text(content)
    (root / "link").symlink_to("sub/f.txt")
    (root / "sub" / "hard").hardlink_to(root / "sub" / "f.txt")
    return root


def _digest_tree(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "->" + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "dir"
    return out


async def test_round_trip_dedup_and_delete(repo: SnapshotRepository, tmp_path: Path) -> None:
    shared_tree = _tree(tmp_path / "shared", "shared")
    shared = await repo.put_layer("upper", shared_tree)
    assert (await repo.put_layer("upper", shared_tree)).digest == shared.digest  # content-addressed
    own = await repo.put_layer("upper", _tree(tmp_path / "own", "own"))
    blob = tmp_path / "mem.bin"
    blob.write_bytes(os.urandom(3 << 20) + b"\x00" * (1 << 20))  # bigger than one read chunk
    mem = await repo.put_layer("memory", blob)
    await repo.put_manifest(Manifest("snap1", "full", "ns", "base", [shared, own, mem]))
    await repo.put_manifest(Manifest("snap2", "filesystem", "ns", "base", [shared], parent="snap1"))
    assert sorted(await repo.list_manifests()) == ["snap1", "snap2"]

    got = await repo.get_manifest("snap1")
    assert got.layers == [shared, own, mem]
    await repo.get_layer(shared, tmp_path / "back")
    assert _digest_tree(tmp_path / "back") == _digest_tree(shared_tree)
    assert os.stat(tmp_path / "back" / "sub" / "hard").st_ino == os.stat(tmp_path / "back" / "sub" / "f.txt").st_ino
    await repo.get_layer(mem, tmp_path / "mem2.bin")
    assert (tmp_path / "mem2.bin").read_bytes() == blob.read_bytes()

    assert await repo.delete("snap1") == 2  # own + mem; shared is still snap2's
    await repo.get_layer(shared, tmp_path / "still")
    for gone in (own, mem):
        with pytest.raises(FileNotFoundError):
            await repo.get_layer(gone, tmp_path / "gone")
    assert await repo.delete("snap2") == 1
    assert [k async for b in obstore.list(repo.store) for k in b] == []  # nothing left behind


async def test_tampered_layer_is_refused(repo: SnapshotRepository, tmp_path: Path) -> None:
    f = tmp_path / "blob"
    f.write_bytes(b"hello")
    ref = await repo.put_layer("disk", f)
    await obstore.put_async(repo.store, layer_key(ref.digest), b"hellO")
    with pytest.raises(OSError, match="corrupt"):
        await repo.get_layer(ref, tmp_path / "x")
    assert not (tmp_path / "x").exists()


async def test_publish_and_materialize_a_stacked_snapshot(repo: SnapshotRepository, tmp_path: Path) -> None:
    """An ns-shaped snapshot: its own ``upper`` plus a parent's ``upper`` it stacks on."""
    parent = tmp_path / "snapshots" / "parent"
    _tree(parent / "upper", "parent")
    child = tmp_path / "snapshots" / "child"
    _tree(child / "upper", "child")
    result = {"layers": ["upper"], "stack": [str(parent / "upper")], "base_lowers": ["/cache/template/rootfs"],
              "paused_ms": 3.5, "data": {"compacted": False}}
    p_manifest = await publish_snapshot(repo, snapshot_id="parent", directory=parent, mode="filesystem", runtime="ns",
                                        template_id="base", result={"layers": ["upper"], "stack": [],
                                                                    "base_lowers": ["/cache/template/rootfs"]})
    manifest = await publish_snapshot(repo, snapshot_id="child", directory=child, mode="filesystem", runtime="ns",
                                      template_id="base", result=result, parent="parent", name="step")
    assert [layer.name for layer in manifest.layers] == ["upper.tar.zst", "stack/0.tar.zst"]
    assert manifest.layers[1].digest == p_manifest.layers[0].digest  # the parent's upper is stored once
    assert manifest.runtime_data == {"compacted": False}  # the runtime's own facts, no host paths

    dest = tmp_path / "elsewhere" / "snapshots" / "child"
    dest.parent.mkdir(parents=True)
    back = await materialize(repo, await repo.get_manifest("child"), dest, ["/other/host/rootfs"])
    assert back["layers"] == ["upper"] and back["paused_ms"] == 3.5 and back["data"] == {"compacted": False}
    # host paths rewritten for this host: the parent's layer as fetched, this host's template lowers
    assert back["stack"] == [str(dest / "stack" / "0")] and back["base_lowers"] == ["/other/host/rootfs"]
    assert _digest_tree(dest / "upper") == _digest_tree(child / "upper")
    assert _digest_tree(dest / "stack" / "0") == _digest_tree(parent / "upper")
    assert not list(dest.parent.glob(".fetch-*"))
    with pytest.raises(ManifestError, match="template's lowers"):
        await materialize(repo, await repo.get_manifest("child"), tmp_path / "third" / "child", None)


async def test_a_manifest_published_before_records_had_a_stack_still_materializes(
    repo: SnapshotRepository, tmp_path: Path
) -> None:
    """Older servers kept the ns stack in the runtime data (``lowers`` + ``snapshot_depth``)."""
    parent = tmp_path / "snapshots" / "parent"
    _tree(parent / "upper", "parent")
    child = tmp_path / "snapshots" / "child"
    _tree(child / "upper", "child")
    legacy = {"layers": ["upper"], "data": {
        "lowers": [str(parent / "upper"), "/cache/template/rootfs"], "snapshot_depth": 1, "compacted": False}}
    manifest = await publish_snapshot(repo, snapshot_id="old", directory=child, mode="filesystem", runtime="ns",
                                      template_id="base", result=legacy)
    manifest.runtime_data = dict(legacy["data"])  # as an older server wrote it
    manifest.meta.pop("needs_template_lowers")
    await repo.put_manifest(manifest)
    dest = tmp_path / "elsewhere" / "old"
    dest.parent.mkdir(parents=True)
    back = await materialize(repo, await repo.get_manifest("old"), dest, ["/other/host/rootfs"])
    assert back["stack"] == [str(dest / "stack" / "0")] and back["base_lowers"] == ["/other/host/rootfs"]
    assert back["data"] == {"compacted": False}


async def test_keys_are_required_and_prefixes_isolate(seaweedfs: SeaweedFS, tmp_path: Path) -> None:  # noqa: F811
    wrong = make_store(seaweedfs.url("x"), endpoint=seaweedfs.endpoint, access_key_id="nobody",
                       secret_access_key="wrong", retry_timeout=2)
    with pytest.raises(Exception, match="(?i)denied|forbidden|InvalidAccessKeyId|403"):
        await obstore.put_async(wrong, "k", b"v")
    a, b = unique_prefix("a"), unique_prefix("b")
    ra = SnapshotRepository(seaweedfs.store(a), tmp_path / "sa")
    rb = SnapshotRepository(seaweedfs.store(b), tmp_path / "sb")
    await ra.put_manifest(Manifest("only-in-a", "filesystem", "ns", "base", []))
    assert await rb.find_manifest("only-in-a") is None
    assert await ra.list_manifests() == ["only-in-a"]


async def test_garbage_collection_frees_only_old_unreferenced_layers(repo: SnapshotRepository, tmp_path: Path) -> None:
    f = tmp_path / "a"
    f.write_bytes(b"kept")
    kept = await repo.put_layer("a", f)
    f.write_bytes(b"orphan")  # a publish that died before its manifest
    orphan = await repo.put_layer("a", f)
    await repo.put_manifest(Manifest("s", "filesystem", "ns", "base", [kept]))
    assert await repo.collect_garbage(grace_s=3600) == 0  # too young: may be a publish in progress
    assert await repo.collect_garbage(grace_s=-60) == 1
    assert await repo.layer_exists(kept.digest) and not await repo.layer_exists(orphan.digest)

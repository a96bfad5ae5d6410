"""Snapshot repository on a local object store: dedup, round trip, digest check, GC of unreferenced layers."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.snapshots.manifest import Manifest, ManifestError
from aenv.snapshots.repository import SnapshotRepository, make_store


@pytest.fixture
def repo(tmp_path: Path) -> SnapshotRepository:
    return SnapshotRepository(make_store(f"file://{tmp_path / 'store'}"), tmp_path / "scratch")


def _tree(root: Path, content: str) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "f.txt").write_text(content)
    (root / "link").symlink_to("sub/f.txt")
    return root


async def test_layers_are_content_addressed_and_round_trip(repo: SnapshotRepository, tmp_path: Path) -> None:
    tree = _tree(tmp_path / "a", "same")
    a = await repo.put_layer("upper", tree)
    b = await repo.put_layer("upper", tree)  # stored once: same content, same digest
    c = await repo.put_layer("upper", _tree(tmp_path / "c", "different"))
    assert a.digest == b.digest != c.digest
    out = tmp_path / "out"
    await repo.get_layer(c, out)
    assert (out / "sub" / "f.txt").read_text() == "different"
    assert (out / "link").is_symlink() and (out / "link").read_text() == "different"
    f = tmp_path / "mem.bin"
    f.write_bytes(b"\x00" * 1000 + b"x")
    ref = await repo.put_layer("memory", f)
    await repo.get_layer(ref, tmp_path / "mem2.bin")
    assert (tmp_path / "mem2.bin").read_bytes() == f.read_bytes()


async def test_corrupt_layer_is_detected(repo: SnapshotRepository, tmp_path: Path) -> None:
    f = tmp_path / "blob"
    f.write_bytes(b"hello")
    ref = await repo.put_layer("disk", f)
    stored = next((tmp_path / "store" / "layers").rglob("*"))
    while stored.is_dir():
        stored = next(stored.iterdir())
    stored.write_bytes(b"tampered")
    with pytest.raises(OSError, match="corrupt"):
        await repo.get_layer(ref, tmp_path / "x")


async def test_delete_frees_only_unreferenced_layers(repo: SnapshotRepository, tmp_path: Path) -> None:
    shared = await repo.put_layer("upper", _tree(tmp_path / "s", "shared"))
    own = await repo.put_layer("upper", _tree(tmp_path / "o", "own"))
    await repo.put_manifest(Manifest("snap1", "filesystem", "ns", "base", [shared, own]))
    await repo.put_manifest(Manifest("snap2", "filesystem", "ns", "base", [shared], parent="snap1"))
    assert sorted(await repo.list_manifests()) == ["snap1", "snap2"]
    assert await repo.delete("snap1") == 1
    assert (await repo.get_manifest("snap2")).parent == "snap1"
    await repo.get_layer(shared, tmp_path / "still-there")
    with pytest.raises(FileNotFoundError):
        await repo.get_layer(own, tmp_path / "gone")


def test_manifest_validation() -> None:
    m = Manifest("s", "full", "vm", "base", [], parent=None, runtime_data={"k": 1})
    assert Manifest.from_bytes(m.to_bytes()) == m
    for bad in (b"{", b"[]", b'{"magic":"x"}', b'{"magic":"aenv-snapshot","version":99}', b"x" * (2 << 20)):
        with pytest.raises(ManifestError):
            Manifest.from_bytes(bad)
    raw = m.to_bytes().replace(b'"layers":[]', b'"layers":[{"name":"a","digest":"md5:1","size":1}]')
    with pytest.raises(ManifestError, match="digest"):
        Manifest.from_bytes(raw)


async def test_a_file_and_its_hard_links_are_hashed_once(
    repo: SnapshotRepository, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vm snapshot's base RAM is one hard-linked file in every snapshot of a template: publishing
    the next snapshot must not read its hundreds of MB again. A rewritten file is hashed anew."""
    import os

    from aenv.snapshots import repository

    hashed: list[Path] = []
    real = repository._sha256_file
    monkeypatch.setattr(repository, "_sha256_file", lambda p: hashed.append(p) or real(p))
    base = tmp_path / "ram.img"
    base.write_bytes(b"ram" * 1000)
    os.link(base, tmp_path / "base.ram")
    a = await repo.put_layer("base.ram", base)
    b = await repo.put_layer("base.ram", tmp_path / "base.ram")
    assert a.digest == b.digest and hashed == [base]
    base.write_bytes(b"other")
    c = await repo.put_layer("base.ram", base)
    assert c.digest != a.digest and len(hashed) == 2


def test_a_pack_whose_files_changed_inode_is_taken_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tar's exit 1 (a later snapshot hard-linked a page image mid-read: its ctime changed) packs again;
    any other failure, or the third exit 1, is raised."""
    from aenv.snapshots import repository

    src = tmp_path / "src"
    src.mkdir()
    (src / "pages-1.img").write_bytes(b"p" * 4096)
    real = repository._pack_once
    results = iter([(1, 0, "file changed as we read it")])
    calls: list[int] = []

    def flaky(s: Path, d: Path) -> tuple[int, int, str]:
        calls.append(1)
        return next(results, None) or real(s, d)

    monkeypatch.setattr(repository, "_pack_once", flaky)
    repository.pack_dir(src, tmp_path / "a.tar.zst")
    assert len(calls) == 2
    repository.unpack_dir(tmp_path / "a.tar.zst", tmp_path / "out")
    assert (tmp_path / "out" / "pages-1.img").read_bytes() == b"p" * 4096

    monkeypatch.setattr(repository, "_pack_once", lambda s, d: (1, 0, "file changed as we read it"))
    with pytest.raises(OSError, match="tar 1"):
        repository.pack_dir(src, tmp_path / "b.tar.zst")
    monkeypatch.setattr(repository, "_pack_once", lambda s, d: (2, 0, "Cannot open: Permission denied"))
    with pytest.raises(OSError, match="Permission denied"):
        repository.pack_dir(src, tmp_path / "c.tar.zst")

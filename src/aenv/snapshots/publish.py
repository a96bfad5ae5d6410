"""Moving one snapshot between its local directory and the repository (no store rows, no HTTP here).

**Publish** stores, as content-addressed layers:

* the runtime's own layers: ``SnapshotResult.layers``, paths inside the snapshot directory (ns:
  ``upper`` and, in full mode, ``criu``; vm: the flattened disk and the device+RAM state file);
* the snapshot layers it stacks on, which live in *other* snapshots' directories (the record's
  ``stack``; ns: parent snapshots' ``upper`` dirs) as ``stack/<i>``.
  Packing is deterministic, so a parent's ``upper`` published on its own and as a child's ``stack/0``
  is one object in the store.

The image template under it is *not* published: the receiving server must have the same template
(by ID, else by alias; ``base`` is the same everywhere). Then the manifest is written, last.

**Materialize** downloads every layer (each checked against its sha256 and size) into a hidden
temporary directory beside the destination, rewrites the host paths of the record (``stack`` →
``<dest>/stack/<i>``; ``base_lowers`` → this server's template lowers), and renames the directory into
place: a snapshot directory is complete or absent. The record's keys: ``snapshots/record.py``.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aenv.snapshots.manifest import LayerRef, Manifest, ManifestError
from aenv.snapshots.record import normalize
from aenv.snapshots.repository import SnapshotRepository

STACK = "stack"
UPPER = "upper"  # ns: the snapshot's own files
FETCH_PREFIX = ".fetch-"
_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")


def safe_relpath(rel: str) -> str:
    """A layer's place in a snapshot directory: 1-3 plain path components, nothing that climbs out."""
    parts = str(rel).split("/")
    if not 1 <= len(parts) <= 3 or not all(_PART.match(p) and p not in (".", "..") for p in parts):
        raise ManifestError(f"bad layer path {rel!r}")
    return "/".join(parts)


async def publish_snapshot(
    repo: SnapshotRepository,
    *,
    snapshot_id: str,
    directory: Path,
    mode: str,
    runtime: str,
    template_id: str,
    result: dict[str, Any],
    parent: str | None = None,
    name: str | None = None,
    created_at: float = 0.0,
    meta: dict[str, Any] | None = None,
) -> Manifest:
    """Upload a snapshot's layers, then its manifest. Safe to repeat (layers already stored are not
    uploaded again), which is how a publish killed half-way is resumed."""
    record = normalize(result)
    own = [safe_relpath(rel) for rel in record["layers"]]
    sources = [(rel, directory / rel) for rel in own]
    sources += [(f"{STACK}/{i}", Path(p)) for i, p in enumerate(record["stack"])]
    facts = {"paused_ms": record["paused_ms"], "needs_template_lowers": bool(record["base_lowers"])}
    for _attempt in range(3):
        layers: list[LayerRef] = []
        for rel, path in sources:
            if not path.exists():
                raise FileNotFoundError(f"snapshot {snapshot_id}: layer {rel} is missing ({path})")
            layers.append(await repo.put_layer(rel, path))
        manifest = Manifest(
            snapshot_id=snapshot_id,
            mode=mode,
            runtime=runtime,
            template_id=template_id,
            layers=layers,
            parent=parent,
            runtime_data=record["data"],
            created_at=created_at,
            name=name,
            meta={**(meta or {}), **facts, "paths": [rel for rel, _ in sources], "own_layers": own},
        )
        await repo.put_manifest(manifest)
        # A delete of another snapshot may have freed a shared layer between our existence check
        # and the manifest: check again, and upload what went missing.
        missing = [layer for layer in layers if not await repo.layer_exists(layer.digest)]
        if not missing:
            return manifest
    raise OSError(f"snapshot {snapshot_id}: layers kept disappearing from the repository while publishing")


async def materialize(
    repo: SnapshotRepository, manifest: Manifest, dest: Path, template_lowers: list[str] | None
) -> dict[str, Any]:
    """Download a snapshot into ``dest`` (which must not exist) and return its ``SnapshotRow.result``
    for this host. ``template_lowers``: the overlay lowers of the image template here (ns)."""
    paths = manifest.meta.get("paths")
    if not isinstance(paths, list) or len(paths) != len(manifest.layers):
        raise ManifestError(f"manifest of {manifest.snapshot_id} does not place its layers")
    paths = [safe_relpath(p) for p in paths]
    own = [safe_relpath(p) for p in manifest.meta.get("own_layers") or []]
    depth = sum(1 for p in paths if p.startswith(STACK + "/"))
    legacy = isinstance(manifest.runtime_data.get("lowers"), list)  # published before records had a stack
    record = normalize({"data": manifest.runtime_data, "paused_ms": manifest.meta.get("paused_ms")})
    if legacy and depth != len(record["stack"]):
        raise ManifestError(f"snapshot {manifest.snapshot_id}: {depth} stacked layers, record says otherwise")
    record["layers"] = own
    record["stack"] = [str(dest / STACK / str(i)) for i in range(depth)]
    if legacy or manifest.meta.get("needs_template_lowers"):
        if template_lowers is None:
            raise ManifestError(f"snapshot {manifest.snapshot_id} needs its template's lowers on this host")
        record["base_lowers"] = [str(p) for p in template_lowers]
    await _download(repo, manifest, paths, dest, lambda rel: True)
    return record


async def _download(repo: SnapshotRepository, manifest: Manifest, paths: list[str], dest: Path,
                    wanted: Callable[[str], bool]) -> None:  # fmt: skip
    """The ``wanted`` layers into a hidden directory beside ``dest``, renamed into place when whole."""
    tmp = dest.parent / f"{FETCH_PREFIX}{dest.name}-{secrets.token_hex(4)}"
    try:
        tmp.mkdir(parents=True)
        for layer, rel in zip(manifest.layers, paths, strict=True):
            if wanted(rel):
                await repo.get_layer(layer, tmp / rel)
            elif rel == UPPER:
                (tmp / UPPER).mkdir()
        if dest.exists():  # an empty or partial leftover: the row said it was gone
            shutil.rmtree(dest)
        os.rename(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
        raise


async def materialize_files_elsewhere(
    repo: SnapshotRepository, manifest: Manifest, dest: Path, root: str
) -> dict[str, Any]:
    """``materialize`` for a snapshot whose files this host reads from ``root`` instead (a lazy
    artifact of its whole tree, mounted): its ``upper`` is an empty dir, its stack is not fetched, and
    only its other layers (ns full mode: the CRIU images) are downloaded. The record then rests on
    ``root`` alone."""
    paths = manifest.meta.get("paths")
    if not isinstance(paths, list) or len(paths) != len(manifest.layers):
        raise ManifestError(f"manifest of {manifest.snapshot_id} does not place its layers")
    paths = [safe_relpath(p) for p in paths]
    record = normalize({"data": manifest.runtime_data, "paused_ms": manifest.meta.get("paused_ms")})
    record["layers"] = [safe_relpath(p) for p in manifest.meta.get("own_layers") or []]
    record["stack"], record["base_lowers"] = [], [root]
    record["data"].pop("lowers", None)
    record["data"].pop("snapshot_depth", None)
    await _download(repo, manifest, paths, dest, lambda rel: rel != UPPER and not rel.startswith(STACK + "/"))
    return record


def clean_fetch_leftovers(snapshots_dir: Path) -> None:
    """Remove half-downloaded snapshot directories a killed server left behind."""
    if snapshots_dir.is_dir():
        for p in snapshots_dir.glob(FETCH_PREFIX + "*"):
            shutil.rmtree(p, ignore_errors=True)

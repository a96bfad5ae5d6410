"""Built templates in the snapshot repository: what a node that did not build a template needs to run it.

A template build's result is a snapshot (its final checkpoint, with the step layers under it as its
``stack``): that snapshot is published as any other (``publish.py``: content-addressed layers, then its
manifest). Beside it, one small **template manifest** per template ID, ``templates/<id>.json``, names
that snapshot and carries what the catalog rows of the template hold (one row per tag: ID, alias,
config, resources, owner), the build ID and the image template at its root (by ID, alias and source).
Names point at IDs through ``template-names/<sha256 of the name>.json`` (names may hold ``/``; the
hash keeps the key one plain component).

Order of writes: the snapshot (layers, then its manifest), then the template manifest, then the names;
a reader that finds a name finds its template whole. A delete goes the other way round. The layers a
deleted template's snapshot held are freed by ``SnapshotRepository.delete`` when no other manifest
names them (a rebuild shares the steps it did not change).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from aenv.snapshots.manifest import ManifestError, read_envelope
from aenv.snapshots.repository import SnapshotRepository

MAGIC = "aenv-template"
VERSION = 1
MAX_BYTES = 1 << 20
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")
ROW_FIELDS = ("id", "alias", "config", "cpu_count", "memory_mb", "source", "public")


@dataclass
class TemplateManifest:
    template_id: str  # the template's ID (every tag's row shares it: ``config.family``)
    build_id: str
    snapshot_id: str  # the build's final snapshot, published beside it
    runtime: str
    owner: str = ""
    base: dict[str, Any] = field(default_factory=dict)  # the image template at the root: id, alias, source
    rows: list[dict[str, Any]] = field(default_factory=list)  # one per tag: ROW_FIELDS
    created_at: float = 0.0
    # the template's whole tree as a lazy artifact in the same store ({"digest", "chunks", "stored"}):
    # a node with aenv-lazyd fetches only the chunks its sandboxes read; empty: nodes fetch the layers
    lazy: dict[str, Any] = field(default_factory=dict)

    def names(self) -> list[str]:
        """Every name a create may use for it: the ID, each row's ID and alias, and the plain name."""
        out = [self.template_id]
        for row in self.rows:
            out.append(str(row["id"]))
            if alias := row.get("alias"):
                out += [str(alias), str(alias).partition(":")[0]]
        return list(dict.fromkeys(out))

    def without_row(self, row_id: str) -> TemplateManifest:
        return TemplateManifest(**{**asdict(self), "rows": [r for r in self.rows if r["id"] != row_id]})

    def to_bytes(self) -> bytes:
        return json.dumps({"magic": MAGIC, "version": VERSION, **asdict(self)}, separators=(",", ":"),
                          sort_keys=True).encode()  # fmt: skip

    @classmethod
    def from_bytes(cls, raw: bytes) -> TemplateManifest:
        body = read_envelope(raw, MAGIC, VERSION, MAX_BYTES, "template manifest", "template manifest")
        try:
            rows = [{k: row.get(k) for k in ROW_FIELDS} for row in body["rows"]]
            out = cls(
                template_id=str(body["template_id"]), build_id=str(body["build_id"]),
                snapshot_id=str(body["snapshot_id"]), runtime=str(body["runtime"]), owner=str(body.get("owner") or ""),
                base=dict(body.get("base") or {}), rows=rows, created_at=float(body.get("created_at") or 0.0),
                lazy=dict(body.get("lazy") or {}),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ManifestError(f"malformed template manifest: {exc}") from None
        for ident in (out.template_id, out.snapshot_id, *(str(r["id"]) for r in rows)):
            if not _ID.match(ident):
                raise ManifestError(f"bad ID {ident!r} in the template manifest")
        if not all(isinstance(r["config"], dict) for r in rows):
            raise ManifestError("a row of the template manifest has no config")
        return out


def template_key(template_id: str) -> str:
    if not _ID.match(template_id):
        raise ValueError(f"invalid template id {template_id!r}")
    return f"templates/{template_id}.json"


def name_key(name: str) -> str:
    return f"template-names/{hashlib.sha256(name.encode()).hexdigest()[:40]}.json"


async def _get(repo: SnapshotRepository, key: str) -> bytes | None:
    import obstore

    try:
        result = await obstore.get_async(repo.store, key)
    except FileNotFoundError:
        return None
    return bytes(await result.bytes_async())


async def put_template(repo: SnapshotRepository, manifest: TemplateManifest) -> None:
    """Write the template manifest (its snapshot must be published already), then its names; the names
    only an earlier version had (a tag's row deleted) go."""
    import obstore

    try:
        old = await get_template(repo, manifest.template_id)
    except ManifestError:
        old = None
    await obstore.put_async(repo.store, template_key(manifest.template_id), manifest.to_bytes())
    for name in manifest.names():
        entry = json.dumps({"name": name, "templateID": manifest.template_id}).encode()
        await obstore.put_async(repo.store, name_key(name), entry)
    if old is not None:
        await _drop_names(repo, manifest.template_id, [n for n in old.names() if n not in manifest.names()])


async def _drop_names(repo: SnapshotRepository, template_id: str, names: list[str]) -> None:
    """Delete the name entries among ``names`` that point at ``template_id`` (or cannot be read)."""
    import obstore

    for name in names:
        raw = await _get(repo, name_key(name))
        try:
            points_here = raw is not None and json.loads(raw).get("templateID") == template_id
        except (ValueError, AttributeError):
            points_here = True
        if points_here:
            try:
                await obstore.delete_async(repo.store, name_key(name))
            except FileNotFoundError:
                pass


async def get_template(repo: SnapshotRepository, template_id: str) -> TemplateManifest | None:
    raw = await _get(repo, template_key(template_id))
    if raw is None:
        return None
    manifest = TemplateManifest.from_bytes(raw)
    if manifest.template_id != template_id:
        raise ManifestError(f"template manifest of {template_id} names template {manifest.template_id!r}")
    return manifest


async def find_template(repo: SnapshotRepository, name: str) -> TemplateManifest | None:
    """The template a create's name means (its ID, a row's ID, ``name`` or ``name:tag``), or None."""
    if _ID.match(name) and (found := await get_template(repo, name)) is not None:
        return found
    for candidate in dict.fromkeys((name, name.partition(":")[0])):
        raw = await _get(repo, name_key(candidate))
        try:
            entry = json.loads(raw) if raw else None
        except ValueError:
            entry = None
        if not isinstance(entry, dict) or entry.get("name") != candidate or not isinstance(entry.get("templateID"), str):
            continue
        found = await get_template(repo, entry["templateID"])
        if found is not None and candidate in found.names():
            return found
    return None


async def delete_template(repo: SnapshotRepository, manifest: TemplateManifest) -> None:
    """Take a template out of the repository: its names (those still pointing at it), its manifest, then
    its snapshot (layers no other manifest names are freed)."""
    import obstore

    await _drop_names(repo, manifest.template_id, manifest.names())
    try:
        await obstore.delete_async(repo.store, template_key(manifest.template_id))
    except FileNotFoundError:
        pass
    try:
        await repo.delete(manifest.snapshot_id)
    except FileNotFoundError:
        pass

"""Snapshot repository: content-addressed layers and JSON manifests in an object store.

Default: a local directory (``<state_dir>/snapshot-store``); any S3-compatible store when configured
(``s3://bucket`` with endpoint and keys), both through obstore behind this one small interface.
A layer is a directory packed as tar+zstd (or a single file stored as-is), named by its sha256, so a
layer shared by several snapshots is stored once; ``delete`` frees only layers no manifest references.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aenv.faults import fault_point
from aenv.object_store import describe_store as describe_store  # re-exported: the names callers know
from aenv.object_store import make_store as make_store
from aenv.object_store import s3_credentials as s3_credentials
from aenv.object_store import store_from_url
from aenv.snapshots.manifest import LayerRef, Manifest, ManifestError

_CHUNK = 8 << 20
# Same tree, same bytes: sorted entries, pax headers without atime/ctime (reading a file changes them).
_TAR_DETERMINISTIC = (
    "tar", "--sort=name", "--format=posix", "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime",
    "--numeric-owner", "--xattrs", "--xattrs-include=*", "--sparse",
)


def repository_from_settings(settings: Any, environ: Mapping[str, str] | None = None) -> SnapshotRepository | None:
    """The configured repository (``Settings.snapshot_store_url``), or None when publishing is off."""
    url = settings.snapshot_store_url
    if url is None:
        return None
    store = store_from_url(url, settings.snapshot_store_endpoint, settings.snapshot_store_region, environ)
    return SnapshotRepository(store, settings.state_dir / "snapshot-scratch", url=url)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


TAR_FILE_CHANGED = 1  # GNU tar --create: "file changed as we read it"
PACK_ATTEMPTS = 3


def pack_dir(src: Path, dest: Path) -> None:
    """tar+zstd a directory (numeric owners, xattrs, sparse files) into ``dest``.

    A file whose inode changed while tar read it makes tar exit 1 and the archive is not trusted. CRIU
    page images do that without any byte changing: a later snapshot of the same sandbox hard-links them
    (``runtime/ns/image_links.py``), which changes their ctime. So that exit is tried again (twice, the
    linking takes milliseconds); any other failure, or a third one, is raised."""
    for attempt in range(1, PACK_ATTEMPTS + 1):
        tar_status, zstd_status, why = _pack_once(src, dest)
        if tar_status == 0 and zstd_status == 0:
            return
        if tar_status != TAR_FILE_CHANGED or zstd_status != 0 or attempt == PACK_ATTEMPTS:
            raise OSError(f"packing {src} failed (tar {tar_status}, zstd {zstd_status}){': ' + why if why else ''}")
        time.sleep(0.1 * attempt)


def _pack_once(src: Path, dest: Path) -> tuple[int, int, str]:
    with dest.open("wb") as out, tempfile.TemporaryFile() as err:  # a file: a pipe could fill and block tar
        tar = subprocess.Popen([*_TAR_DETERMINISTIC, "-C", str(src), "-cf", "-", "."], stdout=subprocess.PIPE,
                               stderr=err)  # fmt: skip
        assert tar.stdout is not None
        zstd = subprocess.run(["zstd", "-q", "-T0", "-3", "-c"], stdin=tar.stdout, stdout=out, check=False)
        tar.stdout.close()
        status = tar.wait()
        err.seek(0)
        return status, zstd.returncode, err.read().decode(errors="replace").strip()[-300:]


def unpack_dir(archive: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    zstd = subprocess.Popen(["zstd", "-q", "-d", "-c", str(archive)], stdout=subprocess.PIPE)
    assert zstd.stdout is not None
    tar = subprocess.run(
        ["tar", "--numeric-owner", "--xattrs", "--xattrs-include=*", "-C", str(dest), "-xf", "-"], stdin=zstd.stdout
    )
    zstd.stdout.close()
    if zstd.wait() != 0 or tar.returncode != 0:
        raise OSError(f"unpacking {archive} failed")


def layer_key(digest: str) -> str:
    return f"layers/{digest.replace(':', '/')}"


class SnapshotRepository:
    """Layers under ``layers/sha256/<hex>``, manifests under ``manifests/<snapshot id>.json``.

    Crash safety comes from the order of writes: every layer is complete in the store (one PUT, or a
    multipart upload that only becomes visible when completed) before the manifest naming it is
    written, and a manifest is one PUT. So a reader sees a snapshot whole or not at all; a publish
    that died half-way leaves at most layers no manifest names, which the next publish of the same
    snapshot reuses and ``collect_garbage`` frees once they are older than its grace period."""

    def __init__(self, store: Any, scratch: Path, url: str = "") -> None:
        self.store = store
        self.scratch = scratch
        self.url = url
        scratch.mkdir(parents=True, exist_ok=True)
        # Digests of files already hashed, by identity: snapshot files never change once written,
        # and a vm snapshot's base RAM (hundreds of MB) is one hard-linked file shared by every
        # snapshot of that template, hashed once instead of at every publish.
        self._file_digests: dict[tuple[int, int, int, int], str] = {}

    def clean_scratch(self) -> None:
        """Drop temporary files a killed process left in the scratch dir (call before any work)."""
        for p in self.scratch.glob("*"):
            if p.name.startswith(("layer-", "get-")):
                with contextlib.suppress(OSError):
                    p.unlink()

    # ---- layers ---------------------------------------------------------------------------------
    async def put_layer(self, name: str, path: Path) -> LayerRef:
        """Store a directory or file as a content-addressed layer (no upload if already present).

        A directory is packed into the scratch dir first; a file (snapshot files never change once
        written) is hashed and uploaded in place, without a copy."""
        import obstore

        fd, tmp_name = tempfile.mkstemp(dir=self.scratch, prefix="layer-")
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            is_dir = path.is_dir()
            if is_dir:
                await asyncio.to_thread(pack_dir, path, tmp)
            src = tmp if is_dir else path
            st = src.stat()
            ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            digest = None if is_dir else self._file_digests.get(ident)
            if digest is None:
                digest = await asyncio.to_thread(_sha256_file, src)
                if not is_dir:
                    self._file_digests[ident] = digest
            size = st.st_size
            fault_point("publish.layer")
            if not await self.layer_exists(digest):
                with src.open("rb") as fh:
                    await obstore.put_async(self.store, layer_key(digest), fh)
            return LayerRef(name=name + (".tar.zst" if is_dir else ""), digest=digest, size=size)
        finally:
            tmp.unlink(missing_ok=True)

    async def layer_exists(self, digest: str) -> bool:
        import obstore

        try:
            await obstore.head_async(self.store, layer_key(digest))
            return True
        except FileNotFoundError:
            return False

    async def get_layer(self, layer: LayerRef, dest: Path) -> None:
        """Fetch a layer, verify its size and digest, and unpack (directories) or place (files) it at
        ``dest``. Nothing is written at ``dest`` unless the bytes check out."""
        import obstore

        fd, tmp_name = tempfile.mkstemp(dir=self.scratch, prefix="get-")
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            result = await obstore.get_async(self.store, layer_key(layer.digest))
            with tmp.open("wb") as fh:
                async for chunk in result.stream():
                    fh.write(chunk)
            got = await asyncio.to_thread(_sha256_file, tmp)
            if got != layer.digest or tmp.stat().st_size != layer.size:
                raise OSError(f"layer {layer.digest} is corrupt in the store (got {got}, {tmp.stat().st_size} bytes)")
            if layer.name.endswith(".tar.zst"):
                await asyncio.to_thread(unpack_dir, tmp, dest)
            else:
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(tmp), dest)
        finally:
            tmp.unlink(missing_ok=True)

    # ---- manifests ------------------------------------------------------------------------------
    @staticmethod
    def _manifest_key(snapshot_id: str) -> str:
        if not snapshot_id or "/" in snapshot_id or snapshot_id.startswith(".") or len(snapshot_id) > 128:
            raise ValueError(f"invalid snapshot id {snapshot_id!r}")
        return f"manifests/{snapshot_id}.json"

    async def put_manifest(self, manifest: Manifest) -> None:
        """Write the manifest: call it last, once every layer it names is stored (one PUT: atomic)."""
        import obstore

        await obstore.put_async(self.store, self._manifest_key(manifest.snapshot_id), manifest.to_bytes())

    async def get_manifest(self, snapshot_id: str) -> Manifest:
        """The manifest of a snapshot (FileNotFoundError if the store has none, ManifestError if bad)."""
        import obstore

        result = await obstore.get_async(self.store, self._manifest_key(snapshot_id))
        manifest = Manifest.from_bytes(bytes(await result.bytes_async()))
        if manifest.snapshot_id != snapshot_id:
            raise ManifestError(f"manifest of {snapshot_id} names snapshot {manifest.snapshot_id!r}")
        return manifest

    async def find_manifest(self, snapshot_id: str) -> Manifest | None:
        try:
            return await self.get_manifest(snapshot_id)
        except FileNotFoundError:
            return None

    async def list_manifests(self) -> list[str]:
        import obstore

        out = []
        async for batch in obstore.list(self.store, prefix="manifests/"):
            for meta in batch:
                if meta["path"].endswith(".json"):
                    out.append(Path(meta["path"]).stem)
        return out

    async def _referenced(self) -> set[str]:
        """Digests some manifest names. A manifest that cannot be read counts as naming nothing."""
        used: set[str] = set()
        for other in await self.list_manifests():
            try:
                used |= {layer.digest for layer in (await self.get_manifest(other)).layers}
            except (FileNotFoundError, ManifestError, ValueError):
                continue
        return used

    async def delete(self, snapshot_id: str) -> int:
        """Delete a manifest and every layer no other manifest references. Returns layers freed."""
        import obstore

        victim = await self.get_manifest(snapshot_id)
        await obstore.delete_async(self.store, self._manifest_key(snapshot_id))
        still_used = await self._referenced()
        freed = 0
        for digest in {layer.digest for layer in victim.layers} - still_used:
            try:
                await obstore.delete_async(self.store, layer_key(digest))
                freed += 1
            except FileNotFoundError:
                pass
        return freed

    async def collect_garbage(self, grace_s: float) -> int:
        """Free layers no manifest names that are older than ``grace_s`` seconds: what a publish
        killed half-way left behind. The grace period protects a publish in progress elsewhere (its
        layers land before its manifest). Returns layers freed."""
        import obstore

        cutoff = time.time() - grace_s
        candidates: list[str] = []
        async for batch in obstore.list(self.store, prefix="layers/"):
            for meta in batch:
                if meta["last_modified"].timestamp() < cutoff:
                    candidates.append(meta["path"])
        if not candidates:
            return 0
        used = {layer_key(d) for d in await self._referenced()}
        freed = 0
        for key in candidates:
            if key not in used:
                with contextlib.suppress(FileNotFoundError):
                    await obstore.delete_async(self.store, key)
                    freed += 1
        return freed

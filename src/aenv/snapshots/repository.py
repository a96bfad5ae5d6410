"""Snapshot repository: content-addressed layers and JSON manifests in an object store.

Default: a local directory (``<state_dir>/snapshot-store``); any S3-compatible store when configured
(``s3://bucket`` with endpoint and keys), both through obstore behind this one small interface.
A layer is a directory packed as tar+zstd (or a single file stored as-is), named by its sha256, so a
layer shared by several snapshots is stored once; ``delete`` frees only layers no manifest references.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from aenv.core.faults import fault_point
from aenv.snapshots.manifest import LayerRef, Manifest

_CHUNK = 8 << 20
# Same tree, same bytes: sorted entries, pax headers without atime/ctime (reading a file changes them).
_TAR_DETERMINISTIC = (
    "tar", "--sort=name", "--format=posix", "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime",
    "--numeric-owner", "--xattrs", "--xattrs-include=*", "--sparse",
)


def make_store(url: str, **options: Any) -> Any:
    """An obstore store from ``file:///dir``, ``memory:///`` or ``s3://bucket`` (+ endpoint/keys options)."""
    from obstore.store import LocalStore, MemoryStore, S3Store

    if url.startswith("file://"):
        root = Path(url[len("file://") :])
        root.mkdir(parents=True, exist_ok=True)
        return LocalStore(str(root))
    if url.startswith("memory://"):
        return MemoryStore()
    if url.startswith("s3://"):
        bucket = url[len("s3://") :].strip("/")
        client_options: Any = {"allow_http": True} if str(options.get("endpoint", "")).startswith("http://") else {}
        return S3Store(
            bucket,
            endpoint=options.get("endpoint"),
            access_key_id=options.get("access_key_id"),
            secret_access_key=options.get("secret_access_key"),
            region=options.get("region", "us-east-1"),
            virtual_hosted_style_request=False,
            client_options=client_options,
        )
    raise ValueError(f"unsupported snapshot store URL {url!r} (use file://, memory:// or s3://)")


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def pack_dir(src: Path, dest: Path) -> None:
    """tar+zstd a directory (numeric owners, xattrs, sparse files) into ``dest``."""
    with dest.open("wb") as out:
        tar = subprocess.Popen(
            [*_TAR_DETERMINISTIC, "-C", str(src), "-cf", "-", "."],
            stdout=subprocess.PIPE,
        )
        assert tar.stdout is not None
        zstd = subprocess.run(["zstd", "-q", "-T0", "-3", "-c"], stdin=tar.stdout, stdout=out, check=False)
        tar.stdout.close()
        if tar.wait() != 0 or zstd.returncode != 0:
            raise OSError(f"packing {src} failed (tar {tar.returncode}, zstd {zstd.returncode})")


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


class SnapshotRepository:
    def __init__(self, store: Any, scratch: Path) -> None:
        self.store = store
        self.scratch = scratch
        scratch.mkdir(parents=True, exist_ok=True)

    # ---- layers ---------------------------------------------------------------------------------
    async def put_layer(self, name: str, path: Path) -> LayerRef:
        """Store a directory or file as a content-addressed layer (no upload if already present)."""
        import obstore

        fd, tmp_name = tempfile.mkstemp(dir=self.scratch, prefix="layer-")
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            if path.is_dir():
                await asyncio.to_thread(pack_dir, path, tmp)
            else:
                await asyncio.to_thread(shutil.copyfile, path, tmp)
            digest = await asyncio.to_thread(_sha256_file, tmp)
            size = tmp.stat().st_size
            fault_point("publish.layer")
            key = f"layers/{digest.replace(':', '/')}"
            try:
                await obstore.head_async(self.store, key)
            except FileNotFoundError:
                with tmp.open("rb") as fh:
                    await obstore.put_async(self.store, key, fh)
            return LayerRef(name=name + (".tar.zst" if path.is_dir() else ""), digest=digest, size=size)
        finally:
            tmp.unlink(missing_ok=True)

    async def get_layer(self, layer: LayerRef, dest: Path) -> None:
        """Fetch a layer, verify its digest, and unpack (directories) or place (files) it at ``dest``."""
        import obstore

        key = f"layers/{layer.digest.replace(':', '/')}"
        fd, tmp_name = tempfile.mkstemp(dir=self.scratch, prefix="get-")
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            result = await obstore.get_async(self.store, key)
            with tmp.open("wb") as fh:
                async for chunk in result.stream():
                    fh.write(chunk)
            got = await asyncio.to_thread(_sha256_file, tmp)
            if got != layer.digest:
                raise OSError(f"layer {layer.digest} is corrupt in the store (got {got})")
            if layer.name.endswith(".tar.zst"):
                await asyncio.to_thread(unpack_dir, tmp, dest)
            else:
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(tmp), dest)
        finally:
            tmp.unlink(missing_ok=True)

    # ---- manifests ------------------------------------------------------------------------------
    async def put_manifest(self, manifest: Manifest) -> None:
        import obstore

        await obstore.put_async(self.store, f"manifests/{manifest.snapshot_id}.json", manifest.to_bytes())

    async def get_manifest(self, snapshot_id: str) -> Manifest:
        import obstore

        result = await obstore.get_async(self.store, f"manifests/{snapshot_id}.json")
        return Manifest.from_bytes(bytes(await result.bytes_async()))

    async def list_manifests(self) -> list[str]:
        import obstore

        out = []
        async for batch in obstore.list(self.store, prefix="manifests/"):
            for meta in batch:
                out.append(Path(meta["path"]).stem)
        return out

    async def delete(self, snapshot_id: str) -> int:
        """Delete a manifest and every layer no other manifest references. Returns layers freed."""
        import obstore

        victim = await self.get_manifest(snapshot_id)
        await obstore.delete_async(self.store, f"manifests/{snapshot_id}.json")
        still_used: set[str] = set()
        for other in await self.list_manifests():
            try:
                still_used |= {layer.digest for layer in (await self.get_manifest(other)).layers}
            except Exception:
                continue
        freed = 0
        for layer in victim.layers:
            if layer.digest not in still_used:
                try:
                    await obstore.delete_async(self.store, f"layers/{layer.digest.replace(':', '/')}")
                    freed += 1
                except FileNotFoundError:
                    pass
        return freed

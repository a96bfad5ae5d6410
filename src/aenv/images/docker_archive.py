"""Images for Docker inside a sandbox, delivered by the host: fetched once per node through aenv's registry
client (mirrors, credentials, digest checks) into the layer cache as whole blobs, then streamed as the
archive ``docker load`` reads (``docker save``'s format), so that no sandbox pulls from a registry.

The archive (a plain tar, sizes known up front, so it streams with a Content-Length)::

    manifest.json            [{"Config": "<hex>.json", "RepoTags": [...], "Layers": ["<hex>/layer.tar", ...]}]
    <config hex>.json        the image config as the registry served it (its rootfs.diff_ids are checked
                             by docker against every layer it unpacks)
    <blob hex>/layer.tar     each layer blob as stored: gzip or plain tar (docker decompresses what it
                             loads); a zstd layer goes in decompressed, since Docker 20.10 predates zstd
                             layers, and is kept in the cache under its diff_id

Several images share one archive; a layer two of them use is written once.
"""

from __future__ import annotations

import asyncio
import json
import tarfile
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from aenv.images import manifest as m
from aenv.images.cache import LayerCache
from aenv.images.errors import RegistryProtocolError
from aenv.images.reference import parse_reference
from aenv.images.registry import RegistryClient, sha256_hex

BLOCK = 512
CHUNK = 1 << 20
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


@dataclass(frozen=True)
class ArchiveImage:
    """One image as ``docker load`` will name it: the tags it gets, its config, its layer files (bottom
    first) and the cache digests it reads (pinned by the caller while the archive is written)."""

    tags: tuple[str, ...]
    config: bytes
    layers: tuple[Path, ...]
    digests: tuple[str, ...] = ()

    @property
    def config_name(self) -> str:
        return sha256_hex(self.config).split(":", 1)[1] + ".json"


@dataclass(frozen=True)
class Member:
    """One file of the archive: its bytes in memory or a file to copy."""

    name: str
    size: int
    data: bytes | None = None
    path: Path | None = None


def _layer_name(path: Path) -> str:
    return f"{path.name}/layer.tar"  # cache files are named by their sha256 hex


def manifest_json(images: Sequence[ArchiveImage]) -> bytes:
    return json.dumps(
        [{"Config": im.config_name, "RepoTags": list(im.tags), "Layers": [_layer_name(p) for p in im.layers]}
         for im in images],
        separators=(",", ":"),
    ).encode()


def members(images: Sequence[ArchiveImage]) -> list[Member]:
    """The archive's files, each once: manifest.json, then every config and layer."""
    out = [Member("manifest.json", len(body := manifest_json(images)), data=body)]
    seen = {"manifest.json"}
    for im in images:
        if im.config_name not in seen:
            seen.add(im.config_name)
            out.append(Member(im.config_name, len(im.config), data=im.config))
        for path in im.layers:
            name = _layer_name(path)
            if name not in seen:
                seen.add(name)
                out.append(Member(name, path.stat().st_size, path=path))
    return out


def _padding(size: int) -> int:
    return -size % BLOCK


def archive_size(files: Iterable[Member]) -> int:
    """Bytes :func:`archive_chunks` yields: a header block per file, its padded data, two zero blocks."""
    return sum(BLOCK + f.size + _padding(f.size) for f in files) + 2 * BLOCK


def _header(f: Member) -> bytes:
    info = tarfile.TarInfo(f.name)
    info.size = f.size
    info.mode = 0o644
    info.mtime = 0
    return info.tobuf(tarfile.USTAR_FORMAT)


async def archive_chunks(files: Sequence[Member], chunk: int = CHUNK) -> AsyncIterator[bytes]:
    """The tar's bytes; files are read in a worker thread. A file whose size changed is an error
    (the cache never rewrites a published blob, so that means the disk lies)."""
    for f in files:
        yield _header(f)
        if f.data is not None:
            yield f.data
        else:
            assert f.path is not None
            with open(f.path, "rb") as fh:
                left = f.size
                while left > 0:
                    data = await asyncio.to_thread(fh.read, min(chunk, left))
                    if not data:
                        raise OSError(f"{f.path}: shorter than its {f.size} bytes")
                    left -= len(data)
                    yield data
        if pad := _padding(f.size):
            yield b"\0" * pad
    yield b"\0" * (2 * BLOCK)


def _is_zstd(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4) == _ZSTD_MAGIC


async def fetch_image(client: RegistryClient, cache: LayerCache, reference: str, tag: str,
                      owner: str) -> ArchiveImage:
    """Resolve ``reference`` (linux/amd64) and make sure every layer blob is in the cache, pinned under
    ``owner`` as soon as it is there. ``tag``: the name ``docker load`` gives the image."""
    ref = parse_reference(reference)
    resolved = await client.resolve(ref)
    config = await client.get_blob_bytes(resolved.reference, resolved.manifest.config)
    diff_ids = m.parse_config(m.load_json(config, str(ref)), str(ref)).diff_ids
    layers = resolved.manifest.layers
    if len(diff_ids) != len(layers):
        raise RegistryProtocolError(str(ref), f"{len(layers)} layers but {len(diff_ids)} diff_ids in the config")

    async def layer(desc: m.Descriptor, diff_id: str) -> tuple[Path, list[str]]:
        path = await cache.ensure_blob(client, resolved.reference, desc)
        cache.pin(owner, [desc.digest])
        if not await asyncio.to_thread(_is_zstd, path):
            return path, [desc.digest]
        plain = await cache.ensure_plain_tar(path, diff_id, str(ref))
        cache.pin(owner, [diff_id])
        return plain, [desc.digest, diff_id]

    # at once (the cache bounds parallel downloads); a failure is raised once every layer has settled
    got = await asyncio.gather(*(layer(d, i) for d, i in zip(layers, diff_ids, strict=True)), return_exceptions=True)
    for item in got:
        if isinstance(item, BaseException):
            raise item
    done = [item for item in got if not isinstance(item, BaseException)]
    return ArchiveImage((tag,), config, tuple(p for p, _ in done), tuple(d for _, ds in done for d in ds))

"""Lazy images for one server: find an image's lazy artifact, mount it, or convert and publish one.

``ImageBuilder`` asks ``find`` before pulling layers; a hit means the template's root filesystem is
the lazy ext4 served by ``aenv-lazyd``, loop-mounted read-only (``root_of``: the ns overlay lower; its
file, ``file_of``, is the vm disk's raw backing). A miss pulls the whole image as before and then
``convert`` flattens it, writes the ext4, and publishes it (to the image's registry when it accepts a
push, else to the store ``lazy_store``: a directory or s3://), so the next node starts lazily.

Layout: ``<state_dir>/lazy/`` (the daemon's root: mnt/, images/, cache/), ``<state_dir>/lazy/roots/<hex>``
(mounts), ``<lazy_store>/lazy/<hex>/`` (directory or s3:// store), builds under ``<cache_dir>/lazy-build/``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aenv.errors import AenvError
from aenv.images.lazy import publish as pub
from aenv.images.lazy.format import parse_index
from aenv.images.lazy.lazyd import LazyDaemon, LazyUnavailable, fuse_support
from aenv.images.reference import Reference, parse_reference
from aenv.images.registry import RegistryClient
from aenv.object_store import s3_location, store_from_url

if TYPE_CHECKING:
    from aenv.config import Settings

log = logging.getLogger("aenv.lazy")


def lazy_name(manifest_digest: str) -> str:
    return manifest_digest.split(":", 1)[-1][:32]


class LazyImages:
    def __init__(self, settings: Settings, client: RegistryClient) -> None:
        self.client = client
        self.settings = settings
        root = Path(settings.state_dir) / "lazy"
        self.daemon = LazyDaemon(
            root,
            settings.lazy_cache_bytes,
            mirrors=dict(settings.registry_mirrors),
            insecure=tuple(settings.insecure_registries),
        )
        self.roots = root / "roots"
        self.store = store_of(settings)
        self.build_dir = Path(settings.cache_dir) / "lazy-build"
        self.reason = None if settings.lazy_images else "off (lazy_images = false)"
        if self.reason is None:
            self.reason = fuse_support()
        self._converting: dict[str, asyncio.Task[None]] = {}
        self._healing = asyncio.Lock()  # a create waits out a restart half done (daemon up, roots not yet remounted)
        self.conversions = 0  # conversions this server ran (claims lost to another node not counted)
        self.holder = f"{settings.cluster_node_id or socket.gethostname()}:{settings.state_dir}"
        try:  # errors logged before this server started were another server's to report
            self._log_pos = (self.daemon.root / "daemon.log").stat().st_size
        except OSError:
            self._log_pos = 0

    @property
    def store_name(self) -> str:
        return self.store.url if isinstance(self.store, pub.ObjectStore) else str(self.store)

    @property
    def available(self) -> bool:
        return self.reason is None

    def describe(self) -> dict[str, Any]:
        """For doctor and GET /aenv/info: lazy or the full pull, and why."""
        return {
            "lazy_images": self.available,
            "lazy_images_reason": self.reason or "FUSE reader (aenv-lazyd)",
            "lazy_conversions": self.conversions,
        }

    async def find(self, ref: Reference, manifest_digest: str) -> pub.LazyArtifact | None:
        try:
            art = await pub.find_in_registry(self.client, ref, manifest_digest)
        except AenvError as exc:  # a registry with no room for artifacts, or down: try the store
            log.info("lazy artifact lookup in %s failed: %s", ref.name, exc)
            art = None
        if art is not None:
            return art
        if not isinstance(self.store, pub.ObjectStore):
            return await asyncio.to_thread(pub.find_in_dir, self.store, manifest_digest)
        try:
            return await pub.find_in_object_store(self.store, manifest_digest)
        except Exception as exc:  # the store down or refusing: the image is pulled whole
            log.warning("lazy artifact lookup in %s failed: %s", self.store.url, exc)
            return None

    def file_of(self, manifest_digest: str) -> Path:
        return self.daemon.path_of(lazy_name(manifest_digest))

    async def root_of(self, manifest_digest: str, art: pub.LazyArtifact) -> Path:
        """Register the artifact with the daemon and loop-mount its ext4 read-only (idempotent)."""
        name = lazy_name(manifest_digest)
        await asyncio.to_thread(self.daemon.ensure)
        path = self.daemon.register(name, art.index, art.source)
        where = self.roots / name
        if not os.path.ismount(where):
            where.mkdir(parents=True, exist_ok=True)
            await asyncio.to_thread(_mount_ro_ext4, path, where)
        return where

    def convert_in_background(
        self, ref: Reference, manifest_digest: str, manifest_size: int, tree: Callable[[], Awaitable[Path]]
    ) -> None:
        if not self.available or not self.settings.lazy_publish or manifest_digest in self._converting:
            return
        task = asyncio.create_task(self.convert(ref, manifest_digest, manifest_size, tree))
        self._converting[manifest_digest] = task
        task.add_done_callback(lambda _t: self._converting.pop(manifest_digest, None))

    async def convert(
        self, ref: Reference, manifest_digest: str, manifest_size: int, tree: Callable[[], Awaitable[Path]]
    ) -> None:
        """Flat tree → ext4 → published (registry, else store). Failures are logged, never raised.
        One converter per store: a node that finds another's claim leaves the image to it."""
        name = lazy_name(manifest_digest)
        try:
            if not await pub.claim(self.store, manifest_digest, self.holder):
                log.info("lazy conversion of %s left to another node (its claim is in %s)", ref, self.store_name)
                return
        except Exception as exc:
            log.warning("lazy conversion of %s: the claim in %s failed (%s); converting here", ref, self.store_name, exc)
        work = self.build_dir / name
        work.mkdir(parents=True, exist_ok=True)
        self.conversions += 1
        try:
            img = work / "root.ext4"
            await asyncio.to_thread(make_ro_ext4, await tree(), img, self.settings.default_disk_mb)
            try:
                art = await pub.publish_to_registry(
                    self.client, ref, manifest_digest, manifest_size, img, work
                )
            except AenvError as exc:
                log.info("lazy publish to %s refused (%s): using the store %s", ref.name, exc, self.store_name)
                if isinstance(self.store, pub.ObjectStore):
                    art = await pub.publish_to_object_store(self.store, manifest_digest, img, work)
                else:
                    art = await asyncio.to_thread(pub.publish_to_dir, self.store, manifest_digest, img)
            log.info("lazy image of %s published to %s (%d chunks, %d bytes)", ref, art.where,
                     len(art.index.chunks), art.index.stored_bytes)  # fmt: skip
        except Exception as exc:
            log.warning("lazy conversion of %s failed: %s", ref, exc)
            await self._release_claim(manifest_digest)
        finally:
            await asyncio.to_thread(shutil.rmtree, work, True)

    async def _release_claim(self, digest: str) -> None:
        """A failed conversion gives its claim back: the next pull anywhere tries again."""
        try:
            await pub.release_claim(self.store, digest)
        except Exception as exc:  # noqa: BLE001 - a stale claim expires on its own (CLAIM_STALE_S)
            log.warning("lazy conversion claim of %s not released: %s", digest, exc)

    # ---- built templates: a flattened tree in a store, mounted where it is used ---------------------
    async def publish_tree(self, store: pub.Store, digest: str, lowers: list[str]) -> pub.LazyArtifact:
        """Flatten the overlay ``lowers`` (top first) into the ext4 of the lazy format and publish it to
        ``store`` under ``digest``. Raises what failed."""
        work = self.build_dir / lazy_name(digest)
        work.mkdir(parents=True, exist_ok=True)
        try:
            img = work / "root.ext4"
            await asyncio.to_thread(flatten_to_ext4, lowers, img, work / "mnt")
            return await pub.publish_to_store(store, digest, img, work)
        finally:
            await asyncio.to_thread(shutil.rmtree, work, True)

    async def release_root(self, digest: str) -> None:
        """Unmount a root no template uses any more and drop its registration (its chunks age out)."""
        name = lazy_name(digest)
        where = self.roots / name
        if os.path.ismount(where):
            await asyncio.to_thread(subprocess.run, ["umount", str(where)], capture_output=True)
        with contextlib.suppress(OSError):
            where.rmdir()
        (self.daemon.root / "images" / f"{name}.json").unlink(missing_ok=True)

    async def aclose(self) -> None:
        for t in list(self._converting.values()):
            t.cancel()
        await asyncio.gather(*self._converting.values(), return_exceptions=True)

    async def record_prefetch(self, ref: Reference, manifest_digest: str) -> None:
        """Publish the chunks this node's first start of the image touched as its index's prefetch list
        (only where the index has none yet). Failures are logged, never raised."""
        name = lazy_name(manifest_digest)
        try:
            reg = json.loads((self.daemon.root / "images" / f"{name}.json").read_bytes())
            index = parse_index(json.dumps(reg["index"]).encode())
            if index.prefetch:
                return
            touched = (await asyncio.to_thread(self.daemon.stats, name))["touched"]
            new = index.with_prefetch(touched)
            if not new.prefetch:
                return
            src = reg["source"]
            if src.get("kind") == "registry":
                where = parse_reference(str(src["reference"]))
                resolved = await self.client.resolve(ref.with_digest(manifest_digest))
                await pub.push_index(self.client, where, manifest_digest, len(resolved.manifest_bytes), new)
            elif isinstance(self.store, pub.ObjectStore) and src == self.store.source(manifest_digest):
                await pub.write_object_index(self.store, manifest_digest, new)
            elif isinstance(self.store, Path) and src.get("path") == str(pub.store_dir(self.store, manifest_digest) / "data"):
                await asyncio.to_thread(pub.write_dir_index, self.store, manifest_digest, new)
            else:  # found in a store this server no longer uses (lazy_store changed): leave it be
                return
            log.info("lazy image %s: prefetch list of %d chunks published", ref, len(new.prefetch))
        except Exception as exc:
            log.warning("lazy prefetch list of %s not recorded: %s", ref, exc)

    async def supervise(self, every: float = 2.0) -> None:
        """The server's task: a dead aenv-lazyd is started again and the lazy roots mounted anew."""
        while True:
            await asyncio.sleep(every)
            try:
                self.forward_errors()
                await self.heal()
            except Exception as exc:
                log.warning("lazy images: restarting aenv-lazyd failed: %s", exc)

    def forward_errors(self) -> int:
        """The daemon's ERROR lines since the last call (failed fetches, refused chunks), into the server's
        log: a sandbox's EIO is explained where the operator looks. Returns how many."""
        path = self.daemon.root / "daemon.log"
        try:
            with open(path, "rb") as fh:
                if fh.seek(0, os.SEEK_END) < self._log_pos:
                    self._log_pos = 0  # a new log
                fh.seek(self._log_pos)
                data = fh.read(1 << 20)
        except OSError:
            return 0
        text = data[: data.rfind(b"\n") + 1]
        self._log_pos += len(text)
        lines = [ln for ln in text.decode(errors="replace").splitlines() if " ERROR " in ln]
        for ln in lines:
            log.error("aenv-lazyd: %s", ln.split(" ERROR ", 1)[1])
        return len(lines)

    async def ready(self) -> None:
        """Before a sandbox starts on a lazy root: a dead daemon is healed now, and a heal under way is
        waited for, so the new sandbox never lands on the old (dead) mount."""
        await self.heal()

    async def heal(self) -> bool:
        """Restart a dead daemon (its cache is adopted as is) and remount every root; True if it had to."""
        async with self._healing:
            return await self._heal()

    async def _heal(self) -> bool:
        names = self.daemon.registered()
        if not names or self.daemon.alive():
            return False
        log.error("aenv-lazyd is gone: restarting it; sandboxes still on its old mount must be restarted")
        await asyncio.to_thread(self.daemon.ensure)
        for name in names:
            where = self.roots / name
            if not where.is_dir():
                continue
            if os.path.ismount(where):
                await asyncio.to_thread(subprocess.run, ["umount", "-l", str(where)], capture_output=True)
            await asyncio.to_thread(_mount_ro_ext4, self.daemon.path_of(name), where)
        return True

    async def wait_converted(self) -> None:
        """Until every background conversion has ended (tests, and a CLI pull that wants it published)."""
        await asyncio.gather(*self._converting.values(), return_exceptions=True)

    def unmount_all(self) -> None:
        """Detach every lazy root and stop the daemon: only when no sandbox runs on them (tests, teardown)."""
        for where in sorted(self.roots.glob("*")) if self.roots.is_dir() else []:
            subprocess.run(["umount", str(where)], capture_output=True, check=False)
        self.daemon.stop()

    def listing(self) -> list[dict[str, Any]]:
        if not self.daemon.alive():
            return []
        out = []
        for name in self.daemon.registered():
            try:
                st = self.daemon.stats(name)
            except OSError:
                continue
            st.pop("touched", None)
            out.append({"name": name, **st})
        return out

    async def pin(self, manifest_digest: str, pinned: bool = True) -> dict[str, Any]:
        name = lazy_name(manifest_digest)
        try:
            await asyncio.to_thread(self.daemon.pin, name, pinned)
        except OSError as exc:
            raise LazyUnavailable(f"pin {name}: {exc}") from exc
        return {"name": name, **self.daemon.stats(name)}


def store_of(settings: Settings) -> Path | pub.ObjectStore:
    """``lazy_store``: s3://bucket[/prefix] (the snapshot store's endpoint, region and key sources), else
    a directory (``file:///dir`` or a path; unset = ``<state_dir>/lazy-store``)."""
    url = settings.lazy_store
    if not url:
        return Path(settings.state_dir) / "lazy-store"
    return store_at(url, settings)


def store_at(url: str, settings: Settings) -> Path | pub.ObjectStore:
    """The lazy store at ``url`` (s3://bucket[/prefix], file:///dir or a path)."""
    if url.startswith("s3://"):
        where = s3_location(settings.snapshot_store_endpoint, settings.snapshot_store_region)
        store = store_from_url(url, where["endpoint"], where["region"])
        return pub.ObjectStore(store, url, where["endpoint"], where["region"])
    return Path(url[len("file://") :] if url.startswith("file://") else url)


def make_ro_ext4(tree: Path, out: Path, min_mb: int = 0) -> None:
    """The root filesystem image of ``tree``: ext4 with a journal (a vm guest writes it through its
    qcow2 overlay and must survive a crash; ns mounts it ``noload``), at least ``min_mb`` (the vm disk
    size) and 25 % + 64 MiB over the tree. Free space is zero chunks: neither stored nor fetched."""
    du = subprocess.run(["du", "-sxb", str(tree)], capture_output=True, text=True, check=True)
    used = int(du.stdout.split()[0])
    size = max(min_mb, (used + used // 4 + (64 << 20) + (1 << 20) - 1) // (1 << 20))
    out.unlink(missing_ok=True)
    with open(out, "wb") as fh:
        fh.truncate(size << 20)
    subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-E", "root_owner=0:0", "-L", "aenv-root", "-d", str(tree), str(out)],
        check=True, capture_output=True,
    )  # fmt: skip


def flatten_to_ext4(lowers: list[str], out: Path, mnt: Path) -> None:
    """The merged view of overlay layers ``lowers`` (top first: whiteouts and opaque dirs applied) as
    the read-only ext4 of ``make_ro_ext4`` (blocking; mounts the overlay read-only at ``mnt`` meanwhile)."""
    if len(lowers) == 1:
        make_ro_ext4(Path(lowers[0]), out)
        return
    mnt.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", f"ro,lowerdir={':'.join(lowers)}", str(mnt)],
                       capture_output=True, text=True)  # fmt: skip
    if r.returncode != 0:
        raise LazyUnavailable(f"overlay of {len(lowers)} layers: {r.stderr.strip()}")
    try:
        make_ro_ext4(mnt, out)
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True, check=False)


def _mount_ro_ext4(image: Path, where: Path) -> None:
    r = subprocess.run(["mount", "-t", "ext4", "-o", "ro,noload,loop", str(image), str(where)],
                       capture_output=True, text=True)  # fmt: skip
    if r.returncode != 0:
        raise LazyUnavailable(f"mount {image}: {r.stderr.strip()}")

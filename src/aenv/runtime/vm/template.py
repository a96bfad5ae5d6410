"""Templates are snapshots: boot a template's rootfs once, wait for envd, freeze it.

What a built template is, on disk under ``<state_dir>/vm/templates/<key>/``::

    base.qcow2         the template rootfs as ext4 (mkfs.ext4 -d), compacted to qcow2
    disk.qcow2         overlay on base written by the boot; frozen after the snapshot
    empty.qcow2        empty overlay on disk.qcow2: copied per sandbox (the 0.1 ms path)
    config.raw         agent arguments (env, user, start command) read by the guest /init
    device.state       QEMU device state (x-ignore-shared, ~50 KB)
    ram.img            the frozen guest RAM, sparse, on disk: snapshots layered on this RAM
                       (``memlayer``) need exactly it, so it must outlive /dev/shm (a reboot)
    manifest.json      the config the template booted with, so restores use the same shape

and guest RAM in ``<RAM dir>/frozen/<key>.<random>.mem`` (a new name per build: a snapshot names
the RAM it is layered on, and a rebuilt template's RAM differs), a ramfs (``frozen.py``): ``share=on`` while
booting; afterwards only ever mapped ``share=off``, and on a filesystem that refuses the hole
punches QEMU would make for a guest giving memory back, so it never changes again. ``key`` hashes everything that shapes the guest:
template id and rootfs, CPU/RAM/disk, accelerator, guest artifacts and the agent arguments.

:class:`TemplateCache` is a runtime's view of them: the templates it has loaded or built, one build
per key at a time, and their RAM files back in the frozen store when a reboot emptied it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import secrets
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from aenv.errors import RuntimeFailure
from aenv.runtime.base import SandboxImage
from aenv.runtime.envd_client import ENVD_PORT, run_process, until_ready

from . import compat, disk
from .accel import AccelChoice
from .artifacts import GuestArtifacts
from .config import Drive, VmConfig, config_from_json, config_to_json, default_append
from .frozen import copy_sparse
from .initramfs import config_disk_bytes
from .machine import Machine
from .sandbox import VmSandbox, run_paths

log = logging.getLogger(__name__)

MANIFEST_VERSION = 2
SHM_DIR = Path("/dev/shm/aenv")


@dataclass(frozen=True)
class Shape:
    """Guest resources a template snapshot is built for (one snapshot per shape)."""

    cpu_count: int
    memory_mb: int
    disk_mb: int


def agent_args(tpl: SandboxImage) -> list[str]:
    args = ["--env-json", json.dumps(tpl.env, sort_keys=True), "--default-user", tpl.user or "root"]
    args += ["--log", "/dev/console"]  # agent and envd logs land in the VM's console log file
    if tpl.start_cmd:
        args += ["--start-cmd", tpl.start_cmd]
        if tpl.start_user:
            args += ["--start-user", tpl.start_user]
        if tpl.start_cwd:
            args += ["--start-cwd", tpl.start_cwd]
    return args


def template_key(
    tpl: SandboxImage, shape: Shape, accel: AccelChoice, art: GuestArtifacts, append: tuple[str, ...] = ()
) -> str:
    """Everything that shapes the booted guest, kernel command line included (a template booted
    with other kernel words is another template), and the QEMU release: its device state is restored
    into every sandbox's QEMU, so after an upgrade (7.2 → 10) the template is booted again."""
    h = hashlib.sha256()
    facts = [
        MANIFEST_VERSION, tpl.template_id, str(tpl.rootfs), [str(p) for p in tpl.lowers], asdict(shape),
        accel.accel, accel.tsc_khz, art.key(), agent_args(tpl), default_append(), list(append),
        tpl.ready_cmd,  # the snapshot is taken once it passes
        WARM_CMD,  # what the snapshot's page cache holds
        compat.qemu_version(),
        "9p-export",  # the volume export device (volumes.py); templates built before it stay loadable by their keys
    ]  # fmt: skip
    h.update(json.dumps(facts, sort_keys=True, default=str).encode())
    return f"{tpl.template_id[:24]}-{h.hexdigest()[:12]}"


def built_from(key: str, template_id: str) -> bool:
    """Whether the template ``key`` was built from ``template_id`` (any shape, any build). Keys keep
    only the id's first 24 characters: ids that share those match each other too."""
    return key.rsplit("-", 1)[0] == template_id[:24]


@dataclass
class FrozenTemplate:
    key: str
    dir: Path
    cfg: VmConfig  # the boot config (share=on); restores derive theirs with for_restore()

    @property
    def device_state(self) -> Path:
        return self.dir / "device.state"

    @property
    def disk(self) -> Path:
        return self.dir / "disk.qcow2"

    @property
    def empty_overlay(self) -> Path:
        return self.dir / "empty.qcow2"

    @property
    def mem_path(self) -> Path:
        return self.cfg.mem_path

    @property
    def ram_id(self) -> str:
        """Names this build's RAM contents (what a layered snapshot records)."""
        return self.mem_path.name.removesuffix(".mem")

    @property
    def ram_image(self) -> Path:
        return self.dir / "ram.img"

    def complete(self) -> bool:
        """Every file a restore needs exists on disk (a pruned tools image means rebuild). The RAM
        file in /dev/shm may be gone (a reboot): it is copied back from ``ram.img``."""
        needed = [self.device_state, self.disk, self.empty_overlay, self.ram_image, self.cfg.kernel]
        needed += [d.path for d in self.cfg.drives if d.serial != "root"]
        if self.cfg.initrd is not None:
            needed.append(self.cfg.initrd)
        return all(p.is_file() for p in needed)

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            self.mem_path.unlink()


def _boot_config(
    key: str,
    tdir: Path,
    shape: Shape,
    accel: AccelChoice,
    art: GuestArtifacts,
    shm_dir: Path,
    boot_dir: Path,
    append: tuple[str, ...] = (),
) -> VmConfig:
    p = run_paths(boot_dir)
    return VmConfig(
        name=f"tpl-{key}",
        kernel=art.kernel,
        initrd=art.initrd,
        qmp_socket=p["qmp"],
        channel_socket=p["chan"],
        serial_log=p["console"],
        mem_path=shm_dir / f"{key}.{secrets.token_hex(4)}.mem",
        mem_share=True,
        memory_mb=shape.memory_mb,
        cpu_count=min(shape.cpu_count, 16),
        accel=accel.accel,
        tsc_khz=accel.tsc_khz,
        drives=(
            Drive(tdir / "disk.qcow2", "root"),
            Drive(art.tools_image, "tools", "raw", read_only=True),
            Drive(tdir / "config.raw", "config", "raw", read_only=True),
        ),
        network="user",
        append=append,
        share_dir=tdir / "share",  # empty; a sandbox with volumes gets its own export (volumes.py)
    )


def boot_dir_name(key: str) -> str:
    return f"boot-{key[-12:]}"


def load(templates_dir: Path, key: str) -> FrozenTemplate | None:
    """A complete, previously built template, or None."""
    tdir = templates_dir / key
    try:
        manifest = json.loads((tdir / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("version") != MANIFEST_VERSION:
        return None
    tpl = FrozenTemplate(key, tdir, config_from_json(manifest["config"]))
    return tpl if tpl.complete() else None


def _save(tpl: FrozenTemplate) -> None:
    manifest = {
        "version": MANIFEST_VERSION,
        "key": tpl.key,
        "created": time.time(),
        "config": config_to_json(tpl.cfg),
    }
    tmp = tpl.dir / ".manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, default=str, indent=1))
    os.rename(tmp, tpl.dir / "manifest.json")


async def build(
    templates_dir: Path,
    tpl: SandboxImage,
    shape: Shape,
    accel: AccelChoice,
    art: GuestArtifacts,
    boot_timeout: float = 180.0,
    shm_dir: Path = SHM_DIR,
    run_root: Path | None = None,
    append: tuple[str, ...] = (),
) -> FrozenTemplate:
    """Boot the template once, wait for envd, snapshot, stop. Cleans up everything on failure.
    ``append``: extra kernel words (:func:`~.config.accel_append`), part of the key."""
    key = template_key(tpl, shape, accel, art, append)
    tdir = templates_dir / key
    # Sockets and console of the boot VM live in a short run dir (AF_UNIX paths are limited).
    boot_dir = (run_root or tdir) / boot_dir_name(key)
    shutil.rmtree(tdir, ignore_errors=True)
    shutil.rmtree(boot_dir, ignore_errors=True)
    tdir.mkdir(parents=True)
    boot_dir.mkdir(parents=True)
    (tdir / "share").mkdir(mode=0o555)
    shm_dir.mkdir(parents=True, exist_ok=True)
    cfg = _boot_config(key, tdir, shape, accel, art, shm_dir, boot_dir, append)
    result = FrozenTemplate(key, tdir, cfg)
    sbx: VmSandbox | None = None
    t0 = time.perf_counter()
    try:
        source = tpl.rootfs
        if tpl.lazy_file is not None:
            # A lazy image: its ext4 on aenv-lazyd's FUSE mount is the raw backing; nothing is copied,
            # the guest's reads fetch the chunks they touch. Snapshots keep it as their base.
            await disk.create_overlay(tpl.lazy_file, tdir / "base.qcow2", backing_format="raw")
        elif len(tpl.lowers) > 1 or (tpl.lowers and tpl.lowers[0] != tpl.rootfs):
            # An image's layers (top first, overlay whiteouts) merged as overlayfs would show them:
            # the VM's disk is one ext4 tree. A copy, made once per template build and removed.
            from aenv.images.flatten import flatten_layers

            source = await asyncio.to_thread(flatten_layers, tpl.lowers, tdir / "merged-layers")
        if tpl.lazy_file is None:
            raw = await disk.make_ext4(source, tdir / "base.raw", size_mb=shape.disk_mb, label="aenv-root")
            if source != tpl.rootfs:
                await asyncio.to_thread(shutil.rmtree, source, True)
            await disk.to_qcow2(raw, tdir / "base.qcow2")
            raw.unlink()
        await disk.create_overlay(tdir / "base.qcow2", result.disk)
        (tdir / "config.raw").write_bytes(config_disk_bytes(agent_args(tpl)))
        with contextlib.suppress(FileNotFoundError):
            cfg.mem_path.unlink()  # a stale RAM file from an interrupted build
        t_disk = time.perf_counter()
        machine = await Machine.spawn(cfg, stderr_path=run_paths(boot_dir)["stderr"])
        sbx = VmSandbox(cfg.name, machine, boot_dir, key)
        await sbx.wait_envd(boot_timeout)
        if tpl.ready_cmd:
            await wait_ready(sbx, tpl.ready_cmd, boot_timeout)
        await warm_page_cache(sbx)
        t_ready = time.perf_counter()
        await sbx.drop_session()
        snap_ms = await machine.snapshot(result.device_state)
        await machine.kill()
        await asyncio.to_thread(copy_sparse, cfg.mem_path, result.ram_image)
        await disk.create_overlay(result.disk, result.empty_overlay)
        with contextlib.suppress(OSError):
            shutil.copyfile(cfg.serial_log, tdir / "boot-console.log")  # type: ignore[arg-type]
        _save(result)
        shutil.rmtree(boot_dir, ignore_errors=True)
        log.info(
            "template %s built: disk %.1f s, boot→envd %.1f s, snapshot %.1f ms",
            key, t_disk - t0, t_ready - t_disk, snap_ms,
        )  # fmt: skip
        return result
    except BaseException as exc:
        console = ""
        with contextlib.suppress(OSError):
            console = run_paths(boot_dir)["console"].read_text(errors="replace")[-3000:]
        if sbx is not None:
            await sbx.machine.kill()
        await asyncio.shield(asyncio.to_thread(result.remove))
        shutil.rmtree(boot_dir, ignore_errors=True)
        if isinstance(exc, Exception):
            raise TemplateBootError(f"template {tpl.template_id}: {exc}\nguest console:\n{console}") from exc
        raise


# What a sandbox's first commands read (a login shell, Python and the stdlib modules agents and the
# SDK's own tests start servers with), read once before the snapshot, so it lies in the guest's page
# cache of every sandbox restored from it: under TCG the first `python3 -m http.server` went from
# 2.9 s (cold, read through virtio-blk) to 0.9 s. Best effort: an image without Python skips it.
WARM_CMD = ("bash -lc true 2>/dev/null; command -v python3 >/dev/null && "
            "python3 -c 'import http.server, json, asyncio, subprocess, urllib.request' ; true")


async def warm_page_cache(sbx: VmSandbox, timeout: float = 60.0) -> None:
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            await run_process(await sbx.open_stream(ENVD_PORT), "/bin/sh", ["-c", WARM_CMD])
    except Exception as exc:  # noqa: BLE001 - a cold cache is slower, never wrong
        log.info("template page-cache warm-up skipped: %s", exc)
        return
    log.info("template page cache warmed in %.1f s", time.perf_counter() - t0)


async def wait_ready(sbx: VmSandbox, ready_cmd: str, timeout: float) -> None:
    """Run the template's ready command until it exits 0, before the snapshot is taken. Every
    sandbox restores the snapshot, so a start command that was still coming up (a code
    interpreter service: ~40 s under TCG) would come up again, from the same point, in each of
    them; a ready one is listening in all of them at once."""
    t0 = time.perf_counter()
    try:
        await until_ready(lambda: sbx.open_stream(ENVD_PORT), ready_cmd, timeout, interval=0.5)
    except TimeoutError:  # bare, it read "envd unreachable after boot: " with nothing after the colon
        raise TimeoutError(f"the template's ready command {ready_cmd!r} did not pass within {timeout:.0f} s") from None
    log.info("template ready command passed after %.1f s", time.perf_counter() - t0)


class TemplateBootError(RuntimeError):
    """Booting or snapshotting a template failed; the message carries the guest console tail."""


def describe(tpl: FrozenTemplate) -> dict[str, Any]:
    return {"key": tpl.key, "dir": str(tpl.dir), "mem": str(tpl.mem_path), "shape": tpl.cfg.shape()}


class TemplateCache:
    """The frozen templates of one state dir: in memory once loaded or built, on disk under
    ``templates_dir``, their RAM in the frozen store ``frozen_dir`` (``frozen.py``)."""

    def __init__(self, templates_dir: Path, frozen_dir: Path, run_root: Path, boot_timeout: float = 180.0,
                 mem_merge: bool = True) -> None:
        self.templates_dir = templates_dir
        self.mem_merge = mem_merge  # the ksm policy (runtime/ksm.py): the restores' configs carry it
        self.frozen_dir = frozen_dir
        self.run_root = run_root  # where a build's boot VM keeps its sockets
        self.boot_timeout = boot_timeout
        self._templates: dict[str, FrozenTemplate] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.building: set[str] = set()  # boot dir names (under run_root) of builds in flight

    def get(self, key: str) -> FrozenTemplate:
        """A template this cache holds already (the pools spawn only for those)."""
        return self._templates[key]

    async def for_image(
        self, image: SandboxImage, shape: Shape, accel: AccelChoice, art: GuestArtifacts, append: tuple[str, ...]
    ) -> FrozenTemplate:
        """The template for this image and shape: cached, else from disk, else built (one build per key)."""
        key = template_key(image, shape, accel, art, append)
        if (tpl := self._templates.get(key)) is not None:
            return tpl
        async with self._locks.setdefault(key, asyncio.Lock()):
            if (tpl := self._templates.get(key)) is not None:
                return tpl
            tpl = await asyncio.to_thread(load, self.templates_dir, key)
            if tpl is not None and tpl.mem_path.parent != self.frozen_dir:
                log.warning("template %s: RAM file %s not in the frozen store; rebuilding", key, tpl.mem_path)
                tpl = None
            if tpl is not None:
                await self.frozen_ram(tpl.ram_id, tpl.ram_image)  # back from disk after a reboot
            if tpl is None:
                boot_name = boot_dir_name(key)
                self.building.add(boot_name)
                try:
                    tpl = await build(
                        self.templates_dir, image, shape, accel, art, boot_timeout=self.boot_timeout,
                        shm_dir=self.frozen_dir, run_root=self.run_root, append=append,
                    )
                finally:
                    self.building.discard(boot_name)  # fmt: skip
            self._templates[key] = tpl = self._held(tpl)
            return tpl

    async def by_key(self, key: str) -> FrozenTemplate:
        """The template a snapshot or a released sandbox names, loaded from disk if need be."""
        tpl = await self.find(key)
        if tpl is None:
            raise RuntimeFailure(f"template snapshot {key} is gone (RAM file or disk missing)")
        return tpl

    async def find(self, key: str) -> FrozenTemplate | None:
        """``by_key``, or None when this node has no such template. One it is booting right now (its
        warm pool, on a node that just started) is waited for."""
        tpl = self._templates.get(key)
        if tpl is None and (building := self._locks.get(key)) is not None and building.locked():
            async with building:
                tpl = self._templates.get(key)
        if tpl is None:
            tpl = await asyncio.to_thread(load, self.templates_dir, key)
            if tpl is not None:
                self._templates[key] = tpl = self._held(tpl)
        return tpl

    def _held(self, tpl: FrozenTemplate) -> FrozenTemplate:
        """``tpl`` with this node's ``mem_merge``: every restore derives its config from the template's."""
        if tpl.cfg.mem_merge == self.mem_merge:
            return tpl
        return replace(tpl, cfg=replace(tpl.cfg, mem_merge=self.mem_merge))

    async def frozen_ram(self, ram_id: str, image: Path) -> Path:
        """The frozen RAM file ``ram_id`` in the store, copied from its on-disk ``image`` when the
        store lacks it (a reboot emptied /dev/shm, or a snapshot from another machine)."""
        mem = self.frozen_dir / f"{ram_id}.mem"
        if not mem.is_file():
            if not image.is_file():
                raise RuntimeFailure(f"RAM {ram_id}: neither in the frozen store nor on disk ({image})")
            t0 = time.perf_counter()
            n = await asyncio.to_thread(copy_sparse, image, mem)
            log.info("vm: RAM %s back in the frozen store (%.0f MB in %.0f ms)", ram_id, n / 1e6,
                     (time.perf_counter() - t0) * 1000)  # fmt: skip
        return mem

    def forget(self, template_id: str) -> list[str]:
        """Drop the cached templates built from ``template_id`` (it was deleted); returns their keys.
        Files stay: sandboxes and snapshots of them still need them."""
        keys = [k for k in self._templates if built_from(k, template_id)]
        for key in keys:
            del self._templates[key]  # its lock stays: a build in flight under it must stay the only one
        return keys

    def clear(self) -> None:
        self._templates.clear()

"""Process images of fresh sandboxes: a start that cannot come from the warm pool restores one.

Why: where CRIU is usable, sandboxes are started by exec, not forked from the zygote (a zygote child
maps its preloaded modules from the host's mount, which CRIU cannot dump: ``criu.py``). Exec'ing
Python and importing agent and envd costs about 0.5-1 s of CPU under load, so every start the pool
does not serve (a create from a filesystem snapshot, a create while the pool refills) went from
~0.1 s to ~1 s. A ``criu restore`` of a freshly started, warmed agent + envd costs about 0.1 s, and
what it restores was started by exec, so it can be dumped again (snapshot, fork, release).

The image of one template (and internet setting: the upper then holds ``/etc/resolv.conf``) is made
once, in the background, the first time a start misses: a sandbox is started by exec under a
``img-…`` name in the pool dir, warmed like a pooled one, quiesced and dumped (its processes end),
and its upper copied. A start then restores the image's processes into the sandbox's own overlay:
the image's upper as the sandbox's upper, over the snapshot layers asked for and the template's
lowers (``NsSnapshots.restore_processes``), with a new boot id, its own cgroups and network namespace,
and envd ``/init`` with the sandbox's identity, as a fork child gets. A restore that fails drops the
image and the start falls back to exec. Pool refills restore it too (``pooled``: no identity until
the hand-out's ``/init``), so a refill no longer takes an exec start's CPU from the live sandboxes
(back-to-back creates under load: median 199-375 -> 26-97 ms). Images live in the pool dir, so a restart's reconcile
removes them (the next miss makes a new one). Templates with a start command are never imaged:
its process would be restored mid-run into every sandbox instead of starting there. One image per uid
range too (``SandboxSpec.uid_slot``: a team's own on a server with several): a restore cannot move
processes to another range, so a team's first miss makes its own.
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
from collections.abc import Awaitable
from pathlib import Path
from typing import TYPE_CHECKING

from aenv.errors import AenvError
from aenv.runtime.base import RuntimeState, SandboxImage, SandboxSpec
from aenv.runtime.ns import checkpoint
from aenv.runtime.ns.disk import remove_tree
from aenv.runtime.ns.host import NsHost
from aenv.runtime.ns.snapshot import NsSnapshots, copy_tree

if TYPE_CHECKING:
    from aenv.runtime.ns.sandbox import NsSandbox

log = logging.getLogger("aenv.runtime.ns")

ENV_OFF = "AENV_NS_PROC_IMAGES"  # "0": never restore images (every miss execs, as before)
UPPER = "upper"
CRIU_DIR = "criu"


def image_key(template: SandboxImage, allow_internet: bool, tools: Path | None, exe: str | None,
              mergeable: bool = False, merge_idle_s: float = 0.0, uid_slot: int = 0) -> str:
    """Everything the image's processes and files depend on: the template's lowers and agent
    arguments (env, user, ``--mergeable`` and its idle wait: how its mappings are dumped), the tools bundle, the CRIU
    build, the internet setting and the uid range its processes run in."""
    rec = {"lowers": [str(p) for p in (template.lowers or (template.rootfs,))], "env": template.env,
           "user": template.user, "tools": str(tools), "criu": exe, "internet": allow_internet,
           **({"mergeable": True} if mergeable else {}), **({"mergeIdle": merge_idle_s} if mergeable and merge_idle_s else {}),
           **({"uidSlot": uid_slot} if uid_slot else {})}
    return hashlib.sha256(json.dumps(rec, sort_keys=True, default=str).encode()).hexdigest()[:16]


class ProcImages:
    """The images this server made (in memory: the directories do not outlive it) and the builds under way.
    Made from the host's facts; restored by ``snapshots`` (``restore_processes``, ``restore_tree``)."""

    def __init__(self, host: NsHost, snapshots: NsSnapshots) -> None:
        self.host = host
        self.snapshots = snapshots
        self._ready: dict[str, Path] = {}
        self._building: dict[str, asyncio.Task[None]] = {}

    def enabled(self, template: SandboxImage) -> bool:
        return (os.environ.get(ENV_OFF) != "0" and self.host.zygote is None and not template.start_cmd
                and self.host.criu_status().usable)

    def _key(self, template: SandboxImage, allow_internet: bool, uid_slot: int) -> str:
        return image_key(template, allow_internet, self.host.tools, self.host.criu_status().exe,
                         self.host.mergeable, self.host.settings.ksm_idle_s, uid_slot)

    async def start(self, spec: SandboxSpec, template: SandboxImage,
                    snapshot_layers: tuple[str, ...]) -> RuntimeState | None:
        """The sandbox restored from its template's image, or None (no image yet: one is made in the
        background; the caller starts it by exec)."""
        if not self.enabled(spec.template):
            return None
        key = self._key(template, spec.allow_internet, spec.uid_slot)
        image = self._ready.get(key)
        if image is None:
            self._build_soon(key, template, spec.allow_internet, spec.uid_slot)
            return None
        lowers = tuple(Path(p) for p in (template.lowers or (template.rootfs,)))
        try:
            # the image's upper is copied in, not stacked: the image goes with the server (reconcile)
            # while its sandboxes live on
            return await self.snapshots.restore_processes(
                spec, image, (str(image / UPPER), *snapshot_layers), lowers, root=spec.workdir / "ns", stacked=False)
        except AenvError as exc:
            log.warning("sandbox=%s restore of the template's process image failed (%s); starting it by exec",
                        spec.sandbox_id, exc)
            self._drop(key)
            return None

    async def pooled(self, name: str, root: Path, template: SandboxImage, allow_internet: bool,
                     uid_slot: int = 0) -> NsSandbox | None:
        """A pool entry restored from the template's image (no identity yet: the hand-out sends
        ``/init``), or None: no image yet (one is made in the background) or its restore failed.
        Restoring costs a fraction of an exec start's CPU, which every refill otherwise takes from
        the live sandboxes; it runs at the pool's low CPU weight, as an exec'd entry does."""
        if not self.enabled(template):
            return None
        key = self._key(template, allow_internet, uid_slot)
        image = self._ready.get(key)
        if image is None:
            self._build_soon(key, template, allow_internet, uid_slot)
            return None
        s = self.host.settings
        spec = SandboxSpec(sandbox_id=name, template=template, workdir=root.parent, cpu_count=s.default_cpu_count,
                           memory_mb=s.default_memory_mb, disk_mb=s.default_disk_mb, pids_limit=s.pids_limit,
                           allow_internet=allow_internet, uid_slot=uid_slot)
        lowers = tuple(Path(p) for p in (template.lowers or (template.rootfs,)))
        try:
            sbx = await self.snapshots.restore_tree(spec, image, (str(image / UPPER),), lowers, root=root,
                                                    live=False)
        except AenvError as exc:
            log.warning("pool: restore of the template's process image failed (%s); launching by exec", exc)
            self._drop(key)
            return None
        return sbx  # (its cgroups had the pool's weight from the start)

    def _drop(self, key: str) -> None:
        image = self._ready.pop(key, None)
        if image is not None:
            with contextlib.suppress(OSError):
                remove_tree(image)

    def _build_soon(self, key: str, template: SandboxImage, allow_internet: bool, uid_slot: int) -> None:
        if key in self._building:
            return
        task = asyncio.get_running_loop().create_task(self._build(key, template, allow_internet, uid_slot),
                                                      name=f"ns-procimage-{key}")
        self._building[key] = task
        task.add_done_callback(lambda _t: self._building.pop(key, None))

    async def _build(self, key: str, template: SandboxImage, allow_internet: bool, uid_slot: int) -> None:
        host = self.host
        assert host.layout is not None
        dest = host.pool_dir / f"img-{key}"
        name = f"img-{secrets.token_hex(6)}"
        sbx: NsSandbox | None = None
        try:
            sbx = await host.launch(name, host.pool_dir / name, host.pool_opts(template, allow_internet, uid_slot))
            await sbx.warm_up()
            async with sbx.quiesce():
                await _finish_even_if_cancelled(asyncio.to_thread(self._dump, sbx, dest))
            self._ready[key] = dest
            log.info("ns process image of template %s made (%s)", template.template_id, dest)
        except Exception as exc:  # noqa: BLE001 - without an image starts exec, as before
            log.warning("ns process image of template %s could not be made: %s", template.template_id, exc)
            with contextlib.suppress(OSError):
                await asyncio.to_thread(remove_tree, dest)
        finally:
            if sbx is not None:
                await sbx.aclose(remove_dir=host.pool_dir / name)

    def _dump(self, sbx: NsSandbox, dest: Path) -> None:
        """Freeze, dump (the processes end with it), copy the upper; written aside, renamed into place."""
        status = self.host.criu_status()
        assert status.exe is not None and sbx.init is not None
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        sbx.cgroup.freeze()
        checkpoint.dump(status.exe, sbx.init.pid, tmp / CRIU_DIR, freezer=sbx.cgroup.dir("freezer"),
                        run_dir=sbx.paths.run, leave_running=False)
        copy_tree(sbx.paths.upper, tmp / UPPER)
        shutil.rmtree(dest, ignore_errors=True)
        os.rename(tmp, dest)

    async def aclose(self) -> None:
        for task in list(self._building.values()):
            task.cancel()
        if self._building:
            await asyncio.gather(*self._building.values(), return_exceptions=True)


async def _finish_even_if_cancelled(work: Awaitable[None]) -> None:
    """Await ``work`` (a thread's) to its end even when the caller is cancelled (the pool closing), then
    re-raise the cancellation: the sandbox it dumps is closed only after CRIU let go of it. Killed under a
    running dump (its cgroup frozen, its tasks seized), the dump never returned, and neither did the
    shutdown that waited for its thread."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await task
        raise

"""Snapshots, fork and rollback for the ns runtime (the ``SnapshotCapable`` half of ``NsRuntime``).

A sandbox's files are an overlay: read-only lowers (the template's, plus snapshot layers) and its
own upper dir. Everything it changed lives in the upper, so a **filesystem snapshot** is: freeze
(cgroup freezer) → ``cp -a --reflink=auto`` of the upper (ownership, modes, xattrs including
``trusted.overlay.*`` opaque markers, whiteout device nodes, hard links, sparse files) → thaw.

Snapshot directory (owned by the orchestrator; we only write into it)::

    upper/     the sandbox's upper at freeze time (or, compacted, all snapshot layers merged)
    criu/      full mode only: ``criu dump`` images of the process tree

The overlay the sandbox ran on is in the result's typed fields: ``stack`` (the snapshot layers,
``<snap>/upper`` dirs, top first) and ``base_lowers`` (the template's lowers under them); ``data``
adds ``compacted`` (True if this snapshot merged its chain into ``upper``; its stack is then empty).

**Restore** (new sandbox, fork child, rollback) stacks ``<snap>/upper`` on top of the recorded
stack and base lowers and gives the sandbox a fresh empty upper: nothing is copied, the start is a cold start of
agent + envd (about as fast as a pool miss), and the next snapshot of that sandbox copies only
what changed since (an incremental layer). Chains deeper than ``MAX_DEPTH`` snapshot layers, or
whose overlay mount options would not fit in one page, are compacted at snapshot time: the new
snapshot's ``upper`` is the merge of every snapshot layer below it plus the sandbox's upper, and it
rests on the template lowers alone. **Rollback** keeps the sandbox's ID, token, directory and cgroup
name: the new sandbox starts under a temporary name while the old one is killed, then is renamed
into place (see ``NsSnapshots.rollback``). Rollback only ever moves *whole* sandbox roots: with disk
quotas each root is a btrfs subvolume, and nothing inside one can be renamed out of it (``disk.py``).

**Full mode** (processes + memory) needs CRIU >= 4.2, detected at run time (``criu.py``); without it
a full snapshot is refused with StateError (→ 409), never silently downgraded. Fork asks for the best
mode available (``fork_mode``) and reports it in ``SnapshotResult.mode``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import logging
import os
import secrets
import shutil
import stat
import subprocess
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aenv.errors import InvalidRequest, RuntimeFailure, StateError
from aenv.kinds import SnapshotMode
from aenv.runtime.base import RuntimeState, SandboxSpec, SnapshotResult
from aenv.runtime.ns import checkpoint, criu, image_links
from aenv.runtime.ns.bursts import BurstWeights
from aenv.runtime.ns.checkpoint import CheckpointError
from aenv.runtime.ns.disk import remove_tree
from aenv.runtime.ns.host import LaunchReady, NsHost, Prelaunch, Start
from aenv.runtime.ns.images_gate import ImagesGate
from aenv.runtime.ns.restored import Restorer, outlive_cancel
from aenv.runtime.ns.table import NsTable

if TYPE_CHECKING:
    from aenv.runtime.ns.sandbox import NsSandbox

log = logging.getLogger("aenv.runtime.ns")

STUCK_TASK_MARKS = ("Unseizable non-zombie", "Timeout reached")  # CRIU: a task it could not freeze or seize
STUCK_TASK_PAUSE_S = 0.2  # thawed this long before the second try

UPPER = "upper"
CRIU_DIR = "criu"
# Snapshot layers a sandbox may stack before its next snapshot is compacted. Overlay allows 500
# lowers, but the legacy mount(2) options must fit in one page (checked separately) and every
# lookup that misses in a directory present in all layers visits each of them. Measured here
# (stat of a missing name in a dir present in every layer, cold dcache): 7 µs with 1 lower,
# 16 µs with 8, 33 µs with 16, 66 µs with 32; python3 start-up unchanged up to 16. 16 keeps the
# worst case within ~5x of a flat layer while a compaction (a full merge) stays rare.
MAX_DEPTH = 16
LAST_IMAGES_KEPT = 4096  # sandboxes whose latest full snapshot is remembered for linking
ENV_MAX_DEPTH = "AENV_NS_SNAPSHOT_MAX_DEPTH"  # override (tests use a small one to exercise compaction)
MAX_MOUNT_OPTIONS = 3584  # bytes of "lowerdir=…,upperdir=…,workdir=…" (the kernel's limit is one page)
OPAQUE_XATTR = "trusted.overlay.opaque"
MODES = ("full", "filesystem")
MAX_RESTORES = 64  # concurrent process restores (aenv's fork limit): see _restore_pool


# ---- filesystem primitives (blocking; run in a thread) -----------------------------------------
def copy_tree(src: Path, dst: Path) -> None:
    """Copy ``src`` to a new ``dst`` keeping everything overlay needs. ``dst`` must not exist."""
    _run(["cp", "-a", "--reflink=auto", "--sparse=auto", "-T", str(src), str(dst)])


def _run(argv: list[str]) -> None:
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise OSError(errno.EIO, f"{' '.join(argv[:2])} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _opaque(path: str) -> bool:
    try:
        return os.getxattr(path, OPAQUE_XATTR, follow_symlinks=False) == b"y"
    except OSError:
        return False


def _remove(path: Path, st: os.stat_result) -> None:
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _clear_for(layer: Path, dest: Path, rel: str = "") -> list[str]:
    """Make ``dest`` ready to receive ``layer`` copied over it with overlay semantics.

    For every entry of ``layer`` that exists in ``dest``: a non-directory (file, symlink, whiteout)
    replaces whatever was there, so the old entry is removed (never written through: it may be a
    hard link); an opaque directory replaces the old subtree; a plain directory over a directory
    merges (recurse); a plain directory over a non-directory replaces it *and must become opaque*,
    because in the stack the non-directory (or whiteout) stopped lookups into the layers below.
    Returns those paths (relative) to mark opaque after the copy."""
    marks: list[str] = []
    with os.scandir(layer / rel if rel else layer) as it:
        entries = list(it)
    for e in entries:
        r = os.path.join(rel, e.name) if rel else e.name
        target = dest / r
        try:
            tst = os.lstat(target)
        except FileNotFoundError:
            continue
        if e.is_dir(follow_symlinks=False):
            if _opaque(e.path):
                _remove(target, tst)
            elif stat.S_ISDIR(tst.st_mode):
                marks += _clear_for(layer, dest, r)
            else:
                _remove(target, tst)
                marks.append(r)
        else:
            _remove(target, tst)
    return marks


def merge_layers(layers_bottom_first: list[Path], dest: Path) -> None:
    """Squash overlay layers (each an upper dir, lowest first) into one new layer ``dest``.

    Whiteouts and opaque markers are kept: the result still sits on the template lowers, where
    they hide files. Assumes overlay's defaults here (no ``redirect_dir``, no ``metacopy``)."""
    if not layers_bottom_first:
        dest.mkdir()
        return
    copy_tree(layers_bottom_first[0], dest)
    for layer in layers_bottom_first[1:]:
        marks = _clear_for(layer, dest)
        _run(["cp", "-a", "--reflink=auto", "--sparse=auto", "-T", str(layer), str(dest)])
        for r in marks:
            os.setxattr(dest / r, OPAQUE_XATTR, b"y", follow_symlinks=False)


def max_depth() -> int:
    try:
        return max(1, int(os.environ.get(ENV_MAX_DEPTH) or MAX_DEPTH))
    except ValueError:
        return MAX_DEPTH


def needs_compaction(lowers: list[str], depth: int, sample_upper: str) -> bool:
    """Would a sandbox started from a snapshot on top of ``lowers`` be too deep or too long?"""
    if depth + 1 > max_depth():
        return True
    # A restored sandbox mounts lowerdir=<snap>/upper:<lowers…>,upperdir=…,workdir=…
    opts = f"lowerdir={':'.join([sample_upper, *lowers])},upperdir={sample_upper},workdir={sample_upper}"
    return len(opts) > MAX_MOUNT_OPTIONS


def stack_of(snapshot: Path, result: SnapshotResult) -> tuple[tuple[str, ...], tuple[Path, ...]]:
    """(snapshot layers, template lowers) a sandbox restored from ``snapshot`` runs on."""
    upper = snapshot / UPPER
    if not result.base_lowers:
        raise StateError(f"snapshot {snapshot.name} has no usable layer record (no image layers recorded)")
    if not upper.is_dir():
        raise StateError(f"snapshot {snapshot.name} is missing its files ({upper} is gone)")
    return (str(upper), *result.stack), tuple(Path(p) for p in result.base_lowers)


# ---- the SnapshotCapable implementation --------------------------------------------------------
class NsSnapshots:
    """Snapshot/fork/rollback flows (``NsRuntime`` delegates its protocol methods here) over the sandbox
    table, the host's facts and the ``Restorer``; a restore that starts processes fresh calls back the
    runtime's ``launch_ready`` (rollback's new sandbox first ``prelaunch``), and a process restore
    ``start``s the runtime first."""

    def __init__(self, table: NsTable, host: NsHost, restorer: Restorer, *, start: Start,
                 launch_ready: LaunchReady, prelaunch: Prelaunch) -> None:
        self.table = table
        self.host = host
        self.restorer = restorer
        self._start = start
        self._launch_ready = launch_ready
        self._prelaunch = prelaunch
        self._cleanups: set[asyncio.Task[Any]] = set()
        # Each sandbox's latest full snapshot's CRIU images: what the next one's pages are compared to.
        self._last_images: OrderedDict[str, Path] = OrderedDict()
        self._images = ImagesGate()  # restores and the page linker take turns on a dump's images
        self.bursts = BurstWeights()  # a team's burst gives way to another team's creates (bursts.py)

    # -- what is possible --
    def criu_status(self) -> criu.CriuStatus:
        return self.host.criu_status()

    def best_mode(self, sbx: NsSandbox) -> SnapshotMode:
        why = self.host.full_refusal(sbx)
        if why is not None and sbx.nested:
            raise self._nested_refusal(sbx, why)
        return SnapshotMode.FULL if why is None else SnapshotMode.FILESYSTEM

    @staticmethod
    def _nested_refusal(sbx: NsSandbox, why: str) -> StateError:
        """Docker inside on ns: neither its processes (CRIU) nor its images and containers (they live
        beside the root's upper, ``launch.bind_nested_data``, which a filesystem snapshot does not keep)."""
        return StateError(f"sandbox {sbx.name} cannot be snapshotted or forked on ns: {why}", sandbox_id=sbx.name)

    async def fork_mode(self, sandbox_id: str) -> SnapshotMode:
        return await asyncio.to_thread(self.best_mode, self.table.get(sandbox_id))

    # -- snapshot --
    async def snapshot(self, sandbox_id: str, into: Path, mode: SnapshotMode) -> SnapshotResult:
        if mode not in MODES:
            raise InvalidRequest(f"unknown snapshot mode '{mode}': use full or filesystem")
        mode = SnapshotMode(mode)
        sbx = self.table.get(sandbox_id)
        if sbx.nested:
            why = await asyncio.to_thread(self.host.full_refusal, sbx)
            raise self._nested_refusal(sbx, why or "it runs Docker inside")
        if mode is SnapshotMode.FULL:
            why = await asyncio.to_thread(self.host.full_refusal, sbx)
            if why is not None:
                raise StateError(
                    f"sandbox {sandbox_id}: the ns runtime can only take filesystem snapshots here: {why}; "
                    "ask for mode=filesystem", sandbox_id=sandbox_id)
        lowers, depth = self._stack(sandbox_id, sbx)
        compact = needs_compaction(lowers, depth, str(into / UPPER))
        t0 = time.perf_counter()
        try:
            if mode is SnapshotMode.FULL:
                async with sbx.quiesce():
                    frozen_s = await asyncio.to_thread(self._capture, sbx, into, mode)
            else:
                frozen_s = await asyncio.to_thread(self._capture, sbx, into, mode)
            if compact:
                await asyncio.to_thread(self._compact, into, lowers[:depth])
                lowers, depth = lowers[depth:], 0
            else:
                await asyncio.to_thread(os.rename, into / ".capture", into / UPPER)
        except BaseException as exc:
            await asyncio.shield(asyncio.to_thread(_clean_capture, into))
            if isinstance(exc, CheckpointError):  # the sandbox runs on, untouched; nothing is downgraded
                raise StateError(f"sandbox {sandbox_id}: its processes cannot be snapshotted: {exc} "
                                 "(mode=filesystem keeps only its files)", sandbox_id=sandbox_id) from exc
            if isinstance(exc, OSError):
                raise RuntimeFailure(f"sandbox {sandbox_id}: snapshot failed: {exc}", sandbox_id=sandbox_id) from exc
            raise
        data: dict[str, Any] = {
            "compacted": compact, "frozen_ms": round(frozen_s * 1000, 2),
            "took_ms": round((time.perf_counter() - t0) * 1000, 2), "allow_internet": sbx.allow_internet,
        }
        layers: tuple[str, ...] = (UPPER,)
        pending = None
        if mode is SnapshotMode.FULL:
            status = self.criu_status()
            data["criu"] = status.describe()
            data["volume_points"] = sorted(self.table.volume_points(sbx))  # a restore must bind these again
            layers = (UPPER, CRIU_DIR)
            pending = self._link_unchanged_later(sandbox_id, into / CRIU_DIR, data)
        log.info("sandbox=%s snapshot mode=%s depth=%d compacted=%s frozen=%.1fms",
                 sandbox_id, mode, depth, compact, frozen_s * 1000)
        return SnapshotResult(mode=mode, layers=layers, stack=tuple(lowers[:depth]), base_lowers=tuple(lowers[depth:]),
                              paused_ms=round(frozen_s * 1000, 2), data=data, pending=pending)

    def _link_unchanged_later(self, sandbox_id: str, images: Path, data: dict[str, Any]) -> asyncio.Future[None] | None:
        """After the answer: make this dump's pages that equal the sandbox's previous full snapshot's
        parent references (``image_links.py``) and say so in ``data["incremental"]``, once no restore
        reads them (``images_gate.py``: a fork's children restore first); restores asked meanwhile wait."""
        previous = self._last_images.pop(sandbox_id, None)
        self._last_images[sandbox_id] = images
        while len(self._last_images) > LAST_IMAGES_KEPT:
            self._last_images.popitem(last=False)
        if previous is None or not previous.is_dir():
            data["incremental"] = {"parent": None, "why": "the sandbox's first full snapshot in this server"}
            return None

        async def link() -> None:
            try:
                async with self._images.writing(images):
                    linked = await asyncio.to_thread(image_links.link_unchanged, images, previous)
            except Exception as exc:  # noqa: BLE001 - the snapshot is whole either way: only the saving is lost
                log.warning("sandbox=%s snapshot pages not linked to %s: %s", sandbox_id, previous, exc)
                data["incremental"] = {"parent": previous.parent.name, "error": str(exc)}
                return
            if linked is None:
                data["incremental"] = {"parent": None, "why": "no page equal to the previous snapshot's, "
                                       f"or its chain is {image_links.MAX_CHAIN} deep"}
                return
            data["incremental"] = linked.describe()
            log.info("sandbox=%s snapshot shares %d of %d page bytes with %s", sandbox_id, linked.shared_bytes,
                     linked.shared_bytes + linked.stored_bytes, linked.parent)

        return asyncio.ensure_future(link())

    def _stack(self, sandbox_id: str, sbx: NsSandbox) -> tuple[list[str], int]:
        if sbx.lowers:
            return list(sbx.lowers), sbx.snapshot_depth
        spec = self.table.specs.get(sandbox_id)  # adopted from a state written before lowers were recorded
        if spec is None:
            raise StateError(f"sandbox {sandbox_id}: its overlay layers are unknown", sandbox_id=sandbox_id)
        return [str(p) for p in (spec.template.lowers or (spec.template.rootfs,))], 0

    def _capture(self, sbx: NsSandbox, into: Path, mode: str) -> float:
        """Freeze, copy the upper to ``into/.capture`` (+ CRIU dump in full mode), thaw. Returns the
        time the sandbox was frozen. A sandbox that was already paused stays paused."""
        was_frozen = sbx.cgroup.frozen()
        t0 = time.perf_counter()
        if not was_frozen:
            sbx.cgroup.freeze()
        try:
            if mode == "full":
                self._dump_twice_if_stuck(sbx, into / CRIU_DIR, refreeze=not was_frozen)
            copy_tree(sbx.paths.upper, into / ".capture")
        finally:
            if not was_frozen:
                sbx.cgroup.thaw()
        return time.perf_counter() - t0

    def _dump_twice_if_stuck(self, sbx: NsSandbox, images: Path, refreeze: bool) -> None:
        """A task in uninterruptible sleep (I/O under load) cannot be frozen or seized, and CRIU gives
        up after its timeout ("Unseizable ... state D"). That is transient: thaw, let it finish, and
        try once more; any other refusal, or a second one, is the request's answer."""
        try:
            self._criu_dump(sbx, images)
            return
        except CheckpointError as exc:
            if not any(mark in str(exc) for mark in STUCK_TASK_MARKS):
                raise
            log.warning("sandbox=%s: CRIU could not seize a task in time (%s); trying once more", sbx.name, exc)
        shutil.rmtree(images, ignore_errors=True)
        if refreeze:
            sbx.cgroup.thaw()
            time.sleep(STUCK_TASK_PAUSE_S)
            sbx.cgroup.freeze()
        self._criu_dump(sbx, images)

    def _criu_dump(self, sbx: NsSandbox, images: Path, leave_running: bool = True) -> None:
        status = self.criu_status()
        assert status.exe is not None and sbx.init is not None
        checkpoint.dump(status.exe, sbx.init.pid, images, freezer=sbx.cgroup.dir("freezer"),
                        run_dir=sbx.paths.run, leave_running=leave_running, volumes=self.table.volume_points(sbx))

    def _compact(self, into: Path, snapshot_layers_top_first: list[str]) -> None:
        layers = [Path(p) for p in reversed(snapshot_layers_top_first)] + [into / ".capture"]
        merge_layers(layers, into / UPPER)
        shutil.rmtree(into / ".capture")

    # -- restore --
    async def create_from_snapshot(self, spec: SandboxSpec, snapshot: Path, result: SnapshotResult) -> RuntimeState:
        layers, lowers = stack_of(snapshot, result)
        if result.mode is SnapshotMode.FULL:
            # a CRIU restore brings back the dumped mount table: the volumes must be where they were
            dumped = sorted(result.data.get("volume_points") or ())
            if sorted(v.path for v in spec.volumes) != dumped:
                raise InvalidRequest(f"volumeMounts: snapshot {snapshot.name} holds processes (mode full) that had "
                                     f"volumes mounted at {dumped or 'no path'}; a sandbox restored from it mounts "
                                     "volumes at exactly those paths (or use a filesystem snapshot)")
            return await self.restore_processes(spec, snapshot, layers, lowers)
        template = replace(spec.template, lowers=lowers)
        return await self._launch_ready(spec, template, layers)

    async def rollback(self, sandbox_id: str, spec: SandboxSpec, snapshot: Path, result: SnapshotResult) -> RuntimeState:
        """Same ID, token, directory and cgroup name; files from the snapshot, processes started fresh.

        Filesystem mode starts the new sandbox (snapshot layers, empty upper) under a temporary
        name *while* the old one is being killed, then swaps directories and renames the cgroup
        into place, as a pool hand-out does: the call costs about max(stop, start), not their sum.
        The old root is kept aside (whole: it may be a quota subvolume) until the swap succeeded; if
        anything fails, the sandbox is restarted on its own files and the error is raised."""
        layers, lowers = stack_of(snapshot, result)
        sbx = self.table.get(sandbox_id)
        root = sbx.paths.root
        old_lowers, old_depth = self._stack(sandbox_id, sbx)
        token = secrets.token_hex(4)
        aside = root.parent / f".rollback-old-{token}"  # in the workdir: removed with the sandbox
        template = replace(spec.template, lowers=lowers)
        self.table.running.pop(sandbox_id, None)
        fresh: asyncio.Task[NsSandbox] | None = None
        new: NsSandbox | None = None
        if result.mode is not SnapshotMode.FULL:
            fresh = asyncio.create_task(self._prelaunch(
                f"rb-{token}", root.parent / f".rollback-new-{token}", spec, template, layers))
        try:
            await sbx.stop()
            if fresh is not None:
                new = await fresh
                await asyncio.to_thread(os.rename, root, aside)
                state = await self._launch_ready(spec, template, layers, root=root, prelaunched=new)
            else:
                await asyncio.to_thread(os.rename, root, aside)
                state = await self.restore_processes(spec, snapshot, layers, lowers, root=root)
        except Exception:
            log.warning("sandbox=%s rollback to %s failed; restarting it on its own files", sandbox_id, snapshot.name)
            if new is not None:
                await new.aclose()  # idempotent: _launch_ready may have closed it already
            try:
                await asyncio.to_thread(_take_back, root, aside)
                await self._launch_ready(
                    spec, replace(spec.template, lowers=tuple(Path(p) for p in old_lowers[old_depth:])),
                    tuple(old_lowers[:old_depth]), root=root)
            except Exception:
                log.exception("sandbox=%s could not be restarted after a failed rollback", sandbox_id)
            raise
        finally:
            if fresh is not None and not fresh.done():
                fresh.cancel()
        self._discard(aside)
        return state

    def _discard(self, path: Path) -> None:
        """Remove a set-aside root in the background (its size must not add to rollback latency);
        reconciliation removes it if the server dies first."""
        self._background(asyncio.to_thread(remove_tree, path))

    def _background(self, work: Coroutine[Any, Any, object]) -> None:
        """Run ``work`` on, kept until done (``drain`` waits for it)."""
        task = asyncio.get_running_loop().create_task(work)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def drain(self) -> None:
        """Wait for background removals (``NsRuntime.close`` before releasing the volume)."""
        if self._cleanups:
            await asyncio.gather(*self._cleanups, return_exceptions=True)

    async def restore_processes(self, spec: SandboxSpec, snapshot: Path, layers: tuple[str, ...],
                                lowers: tuple[Path, ...], root: Path | None = None,
                                stacked: bool = True) -> RuntimeState:
        sbx = await self.restore_tree(spec, snapshot, layers, lowers, root, stacked=stacked)
        return self.table.state(sbx, spec.workdir)

    async def restore_tree(self, spec: SandboxSpec, snapshot: Path, layers: tuple[str, ...],
                           lowers: tuple[Path, ...], root: Path | None = None, live: bool = True,
                           stacked: bool = False) -> NsSandbox:
        """``criu restore`` of ``snapshot``'s images (a full snapshot, or a template's process image:
        ``procimage.py``) into a fresh overlay that shows the files exactly as at dump time (what CRIU
        needs): ``stacked``, every layer a lower under an empty upper (a snapshot's, which outlives its
        children); otherwise ``layers[0]`` copied in as the upper (a process image's, which does not), in the new sandbox's cgroups
        and a fresh network namespace (``checkpoint.restore``), then the host's connection to the
        restored agent and ``/init`` with the new identity (ID, token, env)."""
        status = self.criu_status()
        if not status.usable or status.exe is None:
            raise StateError(f"snapshot {snapshot.name} holds processes but CRIU is not usable here "
                             f"({status.reason}); start it on a host with CRIU >= 4.2")
        await self._start()
        sbx = self.restorer.sandbox(spec, layers, lowers, root, stacked=stacked, images=snapshot / CRIU_DIR)
        exe, tools = status.exe, self.host.tools or Path("/nonexistent")

        loop = asyncio.get_running_loop()
        on_netns = self.restorer.filter_while_restoring(sbx, loop)

        burst = live and spec.in_burst
        # another team's next create: ahead of the burst (bursts.py)
        refill_first = not live and self.bursts.busy and self.host.settings.team_burst_yield

        lazy = stacked and self.host.settings.ns_fork_lazy_pages  # a snapshot's images outlive the child
        served: list[threading.Thread] = []  # a lazy restore's daemon, still reading the images

        def prepare_and_restore() -> int:
            t0 = time.perf_counter()
            pid = restore_into(sbx, spec, None if stacked else Path(layers[0]), snapshot / CRIU_DIR, exe, tools,
                               on_netns, low_weight=not live and not refill_first,
                               bursts=self.bursts if burst else None, lazy=lazy, served=served)
            log.info("sandbox=%s processes restored in %.1f ms lazy=%s", spec.sandbox_id,
                     (time.perf_counter() - t0) * 1000, lazy)
            return pid

        with (self.bursts.starting(sbx.cgroup) if burst else
              self.bursts.refilling(sbx.cgroup) if refill_first else contextlib.nullcontext()):
            try:
                async with contextlib.AsyncExitStack() as gate:  # its pagemaps never switched mid-restore
                    await gate.enter_async_context(self._images.reading(snapshot / CRIU_DIR))
                    pid = await outlive_cancel(loop.run_in_executor(_restore_pool(), prepare_and_restore))
                    if served:  # ... nor while a lazy daemon still reads them
                        self._background(_release_after(served, gate.pop_all()))
                await self.restorer.attach(sbx, spec, pid, live=live, filtered=on_netns is not None)
            except BaseException as exc:
                await sbx.aclose(remove_dir=None if root else spec.workdir)
                if isinstance(exc, CheckpointError | OSError):
                    raise RuntimeFailure(f"sandbox {spec.sandbox_id}: process restore failed: {exc}",
                                         sandbox_id=spec.sandbox_id) from exc
                raise
        return sbx


_POOL: list[concurrent.futures.ThreadPoolExecutor] = []


def _restore_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for restores: the loop's default executor has ``cpu_count + 4`` threads (6 here), so
    a ``fork(16)`` restored its children in three waves behind each other; each restore is mostly
    waiting on CRIU, so all of a fork's children get a thread (measured: fork x16 2.9 -> 1.8 s)."""
    if not _POOL:
        _POOL.append(concurrent.futures.ThreadPoolExecutor(MAX_RESTORES, thread_name_prefix="aenv-criu-restore"))
    return _POOL[0]


def restore_into(sbx: NsSandbox, spec: SandboxSpec, upper: Path | None, images: Path, exe: str, tools: Path,
                 on_netns: Callable[[int], None] | None = None, low_weight: bool = False,
                 bursts: BurstWeights | None = None, lazy: bool = False,
                 served: list[threading.Thread] | None = None) -> int:
    """Blocking: make ``sbx``'s directory and cgroups, copy ``upper`` in (None: an empty upper, the
    snapshot's upper is a lower of ``sbx``), restore ``images`` (``on_netns``: ``checkpoint.restore``'s); the pid.
    ``low_weight``: a pool refill; CRIU runs in the sandbox's cgroups, so giving them the pool's CPU
    weight first keeps the whole restore, not only what follows it, from slowing live sandboxes. ``bursts``:
    one of a burst's starts, weighed as the burst should be now (``bursts.py``). ``lazy``: CRIU lazy pages."""
    paths, cg, opts = sbx.paths, sbx.cgroup, sbx.opts
    shutil.rmtree(paths.upper, ignore_errors=True)
    if opts is not None and opts.disk is not None:  # the quota subvolume must exist before the copy lands in it
        opts.disk.make_root(paths.root, spec.disk_mb)
    paths.root.mkdir(parents=True, exist_ok=True)
    if upper is not None:
        copy_tree(upper, paths.upper)
    paths.prepare()
    paths.new_boot_id()  # restored processes keep running, but in a sandbox (a boot) of its own
    cg.create()
    cg.set_limits(spec.cpu_count, spec.memory_mb, spec.pids_limit)
    if low_weight:
        cg.set_weight(low=True)
    elif bursts is not None:
        bursts.weigh(cg)
    return checkpoint.restore(exe, images, lowers=sbx.lowers, upper=paths.upper, work=paths.work,
                              merged=paths.merged, run_dir=paths.run, tools=tools, boot_id=paths.boot_id,
                              procs_files=cg.procs_files(), on_netns=on_netns,
                              userns=opts.userns if opts is not None else None, volumes=spec.volumes, lazy=lazy,
                              served=served)


async def _release_after(served: list[threading.Thread], gate: contextlib.AsyncExitStack) -> None:
    """Let go of ``gate`` (the images' read hold) once every lazy daemon in ``served`` has ended."""
    try:
        for reaper in served:
            await asyncio.to_thread(reaper.join)
    finally:
        await gate.aclose()


def _clean_capture(into: Path) -> None:
    for name in (".capture", UPPER, CRIU_DIR):
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(into / name)


def _take_back(root: Path, aside: Path) -> None:
    """Undo the set-aside after a failed start: the old root (moved whole to ``aside``) goes back
    into place over whatever the failed start left there; work, run and the mount point are made
    fresh, the upper is kept. A no-op for the upper if the root never left."""
    from aenv.runtime.ns.paths import Paths

    if aside.exists():
        remove_tree(root)
        os.rename(aside, root)
    Paths(root).reset()

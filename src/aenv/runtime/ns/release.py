"""Paused ns sandboxes released to disk: after ``ns_release_paused_after`` seconds frozen, a sandbox's
process tree is dumped with CRIU into ``<root>/released/criu`` and its processes end, so a long pause
holds no memory; resume restores the tree on the sandbox's own upper (untouched since: nothing ran).

Crash safety: the dump leaves the tree running (frozen); the marker ``released/released.json`` is
written next, and only then are the processes killed. So after a crash either the tree still runs
(no marker: an ordinary paused sandbox; a partial image dir is removed) or the marker says released
(anything left of the sandbox is killed). A resume restores, records the new init in ``ns.json``, and
removes the marker last: a crash in between leaves it released again (the restored tree is killed at
adoption and restored once more at the next resume).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aenv.faults import fault_point
from aenv.runtime.base import SandboxSpec
from aenv.runtime.ns import checkpoint
from aenv.runtime.ns.host import NsHost
from aenv.runtime.ns.restored import Restorer, outlive_cancel
from aenv.runtime.ns.table import NsTable

if TYPE_CHECKING:
    from aenv.runtime.ns.sandbox import NsSandbox

log = logging.getLogger("aenv.runtime.ns")

RELEASED_DIR = "released"
MARKER = "released.json"


def marker(root: Path) -> Path:
    return root / RELEASED_DIR / MARKER


def read_marker(root: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(marker(root).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, or {} when missing, unreadable or not an object (state files after a crash)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_marker(root: Path, data: dict[str, Any]) -> None:
    tmp = marker(root).with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, marker(root))


class NsReleaser:
    """Release timers, the released sandboxes' recorded state, and a lock per sandbox. It takes running
    sandboxes out of the table and, at resume, has the ``Restorer`` put them back."""

    def __init__(self, table: NsTable, host: NsHost, restorer: Restorer, after: float) -> None:
        self.table = table
        self.host = host
        self.restorer = restorer
        self.after = after
        self.released: dict[str, dict[str, Any]] = {}
        self._timers: dict[str, asyncio.Task[None]] = {}  # waiting out ``after``: cancel() stops them
        self._running: set[asyncio.Task[None]] = set()  # releasing now: only shutdown cancels them
        self._locks: dict[str, asyncio.Lock] = {}

    def lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    def schedule(self, sandbox_id: str) -> None:
        """Release after ``after`` s if the sandbox is still paused then (and CRIU can dump it)."""
        self.cancel(sandbox_id)
        task = asyncio.get_running_loop().create_task(self._later(sandbox_id), name=f"ns-release-{sandbox_id}")
        self._timers[sandbox_id] = task
        task.add_done_callback(lambda t: self._timers.pop(sandbox_id, None) if self._timers.get(sandbox_id) is t else None)

    def cancel(self, sandbox_id: str) -> None:
        task = self._timers.pop(sandbox_id, None)
        if task is not None:
            task.cancel()

    async def aclose(self) -> None:
        """Server shutdown: timers and releases under way end (a half-done release is safe: see above)."""
        for sid in list(self._timers):
            self.cancel(sid)
        for task in list(self._running):
            task.cancel()

    async def _later(self, sandbox_id: str) -> None:
        await asyncio.sleep(self.after)
        # From here on the release is not cancelled: a resume that comes meanwhile waits for its lock.
        # Cancelled half-way (after the marker, during the stop) it left a sandbox the resume then
        # thawed while it was being killed (the crash case ns.release.restored never got to its point).
        me = asyncio.current_task()
        if me is not None and self._timers.get(sandbox_id) is me:
            del self._timers[sandbox_id]
            self._running.add(me)
        try:
            await self.release(sandbox_id)
        except Exception:  # the sandbox stays paused in memory, which is still correct
            log.exception("sandbox=%s release to disk failed; it stays paused in memory", sandbox_id)
        finally:
            self._running.discard(me)

    async def settled(self, sandbox_id: str) -> None:
        """Cancel a release not yet begun and wait for one under way (resume, kill)."""
        self.cancel(sandbox_id)
        async with self.lock(sandbox_id):
            pass

    async def release(self, sandbox_id: str) -> bool:
        """Dump the frozen sandbox, mark it released, end its processes. False if it is not releasable."""
        async with self.lock(sandbox_id):
            sbx = self.table.running.get(sandbox_id)
            status = self.host.criu_status()
            if sbx is None or sbx.init is None or status.exe is None or self.host.full_refusal(sbx):
                return False
            if not await asyncio.to_thread(sbx.cgroup.frozen):
                return False  # resumed meanwhile
            root = sbx.paths.root
            images = root / RELEASED_DIR / "criu"
            await asyncio.to_thread(shutil.rmtree, root / RELEASED_DIR, True)
            async with sbx.quiesce():
                await asyncio.to_thread(checkpoint.dump, status.exe, sbx.init.pid, images,
                                        freezer=sbx.cgroup.dir("freezer"), volumes=self.table.volume_points(sbx),
                                        run_dir=sbx.paths.run)
            data = {**sbx.state(), "released": True}
            await asyncio.to_thread(_write_marker, root, data)
            fault_point("ns.release.marked")
            await sbx.stop()  # processes, cgroup and slirp end; the directory stays
            self.table.running.pop(sandbox_id, None)
            self.released[sandbox_id] = data
            log.info("sandbox=%s released to disk (%s)", sandbox_id, images)
            return True

    async def load(self, sandbox_id: str, spec: SandboxSpec) -> NsSandbox:
        """Restore a released sandbox on its own files; caller holds ``lock(sandbox_id)``."""
        data = self.released[sandbox_id]
        status = self.host.criu_status()
        if status.exe is None or not status.usable:
            from aenv.errors import StateError

            raise StateError(f"sandbox {sandbox_id} was released to disk with CRIU, which is not usable now "
                             f"({status.reason})", sandbox_id=sandbox_id)
        root = Path(str(data["dir"]))
        lowers = [str(p) for p in data.get("lowers") or []]
        depth = int(data.get("snapshot_depth") or 0)
        # its own processes: restored in the range they were dumped in, whatever its team's is now
        sbx = self.restorer.sandbox(spec, ("", *lowers[:depth]), tuple(Path(p) for p in lowers[depth:]), root,
                                    images=root / RELEASED_DIR / "criu", own=True)
        exe, tools = status.exe, self.host.tools or Path("/nonexistent")
        on_netns = self.restorer.filter_while_restoring(sbx, asyncio.get_running_loop())

        def restore() -> int:
            from aenv.runtime.ns.paths import Paths

            Paths(root).reset()
            sbx.paths.prepare()
            sbx.cgroup.create()
            sbx.cgroup.set_limits(spec.cpu_count, spec.memory_mb, spec.pids_limit)
            return checkpoint.restore(exe, root / RELEASED_DIR / "criu", lowers=sbx.lowers, upper=sbx.paths.upper,
                                      work=sbx.paths.work, merged=sbx.paths.merged, run_dir=sbx.paths.run,
                                      tools=tools, boot_id=sbx.paths.boot_id, procs_files=sbx.cgroup.procs_files(),
                                      on_netns=on_netns, userns=sbx.opts.userns if sbx.opts else None,
                                      volumes=spec.volumes)

        try:
            pid = await outlive_cancel(asyncio.to_thread(restore))  # a cancelled resume leaves no tree behind
            await self.restorer.attach(sbx, spec, pid, filtered=on_netns is not None)
        except BaseException:
            await sbx.stop()  # its processes and cgroup; the files and the images stay: still released
            raise
        fault_point("ns.release.restored")
        await asyncio.to_thread(shutil.rmtree, root / RELEASED_DIR, True)  # the marker goes with it, last
        self.released.pop(sandbox_id, None)
        log.info("sandbox=%s restored from disk", sandbox_id)
        return sbx

    def forget(self, sandbox_id: str) -> dict[str, Any] | None:
        self.cancel(sandbox_id)
        self._locks.pop(sandbox_id, None)
        return self.released.pop(sandbox_id, None)

    async def adopted(self, sandbox_id: str, root: Path) -> bool:
        """After a restart: a sandbox whose marker says released (kill whatever of it runs) is registered
        released; one that is not loses any partial image dir. True if released."""
        data = await asyncio.to_thread(read_marker, root)
        if data is None:
            with contextlib.suppress(OSError):
                await asyncio.to_thread(shutil.rmtree, root / RELEASED_DIR)
            return False
        from aenv.runtime.ns import cgroups
        from aenv.runtime.ns.paths import STATE_FILE
        from aenv.runtime.ns.sandbox import NsSandbox

        layout = self.host.layout
        assert layout is not None
        # What the marker recorded (the dumped tree, its slirp4netns: outside the cgroup) and what
        # ns.json says now (a tree a resume restored before the crash, with its own slirp).
        on_disk = await asyncio.to_thread(read_json, root / STATE_FILE)
        for recorded in (data, on_disk):
            if recorded.get("pid") and recorded.get("cgroup") and recorded.get("dir"):
                with contextlib.suppress(Exception):
                    await NsSandbox.from_state(layout, recorded).stop()
        cg = cgroups.Cgroup(layout, sandbox_id)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(cg.kill_all)
            await asyncio.to_thread(cg.remove)
        self.released[sandbox_id] = data
        return True

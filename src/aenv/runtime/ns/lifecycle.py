"""Pause, resume, kill and adoption of ns sandboxes (``NsRuntime`` delegates those methods here).

Pause is the cgroup freezer; a paused sandbox CRIU can dump is released to disk after
``ns_release_paused_after`` s (``release.py``), and a resume or kill waits for a release under way.
A files-only pause (``keep_memory=False``) ends every process instead and keeps the directory (upper,
boot id); the sandbox is then *stopped*, and its resume is a cold start on the same upper and lowers
under the same ID: new processes, a new boot id. After a restart, ``adopt`` takes back what the store
says runs (or was paused, stopped, released) and ends whatever of a stopped one still runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from aenv.errors import RuntimeFailure, SandboxNotFound
from aenv.runtime.base import RuntimeState, SandboxSpec
from aenv.runtime.egress import ENFORCER
from aenv.runtime.network import Slirp, foreign_rules
from aenv.runtime.ns import cgroups
from aenv.runtime.ns.disk import remove_tree
from aenv.runtime.ns.host import LaunchReady, NsHost, Start
from aenv.runtime.ns.paths import STATE_FILE, Paths
from aenv.runtime.ns.release import RELEASED_DIR, NsReleaser, read_json
from aenv.runtime.ns.sandbox import NsSandbox
from aenv.runtime.ns.table import NsTable
from aenv.runtime.shaping import SHAPER

log = logging.getLogger("aenv.runtime.ns")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


class NsLifecycle:
    """``pause``/``resume``/``kill``/``adopt`` over the sandbox table, the host's facts and the releaser;
    a cold start calls back the runtime's ``launch_ready``, and every entry but pause ``start``s it first."""

    def __init__(self, table: NsTable, host: NsHost, releaser: NsReleaser, *, start: Start,
                 launch_ready: LaunchReady) -> None:
        self.table = table
        self.host = host
        self.releaser = releaser
        self._start = start
        self._launch_ready = launch_ready

    async def pause(self, sandbox_id: str, keep_memory: bool = True) -> RuntimeState:
        if sandbox_id in self.table.stopped:
            return self._stopped_state(sandbox_id)
        sbx = self.table.get(sandbox_id)
        if not keep_memory:
            return await self._stop(sandbox_id, sbx)
        try:
            await asyncio.to_thread(sbx.cgroup.freeze)
        except OSError as exc:
            raise RuntimeFailure(f"sandbox {sandbox_id}: freeze failed: {exc}", sandbox_id=sandbox_id) from exc
        # The proxy's idle keep-alive streams must not be reused into a frozen sandbox (a request
        # would hang instead of getting 502); envd keeps processes whose client left.
        await sbx.drop_connections()
        self._schedule_release(sbx)
        return self.table.state(sbx, self.table.workdir(sandbox_id))

    def _schedule_release(self, sbx: NsSandbox) -> None:
        """A paused sandbox goes to disk after ns_release_paused_after s (``release.py``), where CRIU can dump it."""
        if self.host.full_refusal(sbx) is None:
            self.releaser.schedule(sbx.name)

    async def _stop(self, sandbox_id: str, sbx: NsSandbox) -> RuntimeState:
        """Files only: every process ends (init, cgroup, slirp), the directory stays; ``ns.json``
        records it stopped, so nothing is left to kill after a crash."""
        await sbx.stop()
        self.table.running.pop(sandbox_id, None)
        data = {**sbx.state(), "pid": None, "start": None, "slirp": None, "stopped": True}
        await asyncio.to_thread(_write_json, sbx.paths.state_file, data)
        self.table.stopped[sandbox_id] = data
        log.info("sandbox=%s stopped (files kept)", sandbox_id)
        return self._stopped_state(sandbox_id)

    def _stopped_state(self, sandbox_id: str) -> RuntimeState:
        workdir = self.table.workdir(sandbox_id)
        return RuntimeState(data={**self.table.stopped[sandbox_id], "workdir": str(workdir) if workdir else None})

    async def _cold_start(self, sandbox_id: str, state: RuntimeState) -> RuntimeState:
        """Start a stopped sandbox again on its own files (a paused one's memory is discarded first):
        same ID, directory, upper and lowers; new processes and boot id; envd initialised anew."""
        spec = self.table.specs.get(sandbox_id)
        if spec is None:
            raise SandboxNotFound(sandbox_id)
        if sandbox_id not in self.table.stopped:
            sbx = self._from_state(sandbox_id, state)
            if sbx is None:
                raise SandboxNotFound(sandbox_id)
            await self._stop(sandbox_id, sbx)
        data = self.table.stopped[sandbox_id]
        lowers = [str(p) for p in data.get("lowers") or (spec.template.lowers or (spec.template.rootfs,))]
        depth = int(data.get("snapshot_depth") or 0)
        root = Path(str(data.get("dir") or spec.workdir / "ns"))
        await asyncio.to_thread(Paths(root).reset)
        template = replace(spec.template, lowers=tuple(Path(p) for p in lowers[depth:]))
        new = await self._launch_ready(spec, template, tuple(lowers[:depth]), root=root)
        self.table.stopped.pop(sandbox_id, None)
        log.info("sandbox=%s cold start on its files", sandbox_id)
        return new

    async def resume(self, sandbox_id: str, state: RuntimeState, keep_memory: bool = True) -> RuntimeState:
        """Thaw, restore from disk or cold-start; the runtime then ensures its egress policy."""
        await self._start()
        await self.releaser.settled(sandbox_id)  # a release under way ends first, either way
        if sandbox_id in self.releaser.released:
            return await self._resume_released(sandbox_id, state, keep_memory)
        if not keep_memory or sandbox_id in self.table.stopped or state.data.get("stopped"):
            return await self._cold_start(sandbox_id, state)
        sbx = self._from_state(sandbox_id, state)
        if sbx is None or not sbx.alive():
            raise SandboxNotFound(sandbox_id)
        try:
            await asyncio.to_thread(sbx.cgroup.thaw)
        except OSError as exc:
            raise RuntimeFailure(f"sandbox {sandbox_id}: thaw failed: {exc}", sandbox_id=sandbox_id) from exc
        self.table.running.setdefault(sandbox_id, sbx)
        return self.table.state(sbx, self.table.workdir(sandbox_id, state))

    async def _resume_released(self, sandbox_id: str, state: RuntimeState, keep_memory: bool) -> RuntimeState:
        """Processes back from disk (``release.py``); a resume without memory drops the images and cold-starts."""
        spec = self.table.specs.get(sandbox_id)
        if spec is None:
            raise SandboxNotFound(sandbox_id)
        async with self.releaser.lock(sandbox_id):
            if not keep_memory:
                data = self.releaser.forget(sandbox_id) or {}
                root = Path(str(data.get("dir") or spec.workdir / "ns"))
                await asyncio.to_thread(remove_tree, root / RELEASED_DIR)
                self.table.stopped[sandbox_id] = {**data, "pid": None, "start": None, "slirp": None, "stopped": True}
                return await self._cold_start(sandbox_id, state)
            sbx = await self.releaser.load(sandbox_id, spec)
        return self.table.state(sbx, spec.workdir)

    async def kill(self, sandbox_id: str, state: RuntimeState | None = None) -> None:
        await self._start()
        if (live := self.table.running.get(sandbox_id)) is not None:
            await live.egress.settled()  # else its filter (and listener) could land after the forget
        ENFORCER.forget(sandbox_id)
        SHAPER.forget(sandbox_id)
        workdir = self.table.workdir(sandbox_id, state)
        await self.releaser.settled(sandbox_id)
        released = self.releaser.forget(sandbox_id)
        stopped = self.table.stopped.pop(sandbox_id, None) or released
        sbx = self.table.running.pop(sandbox_id, None) or self._from_state(sandbox_id, state) \
            or self._from_state_file(sandbox_id)
        if sbx is None and stopped is not None and self.host.layout is not None:
            sbx = NsSandbox.from_state(self.host.layout, stopped)
        self.table.specs.pop(sandbox_id, None)
        if sbx is not None:
            await sbx.aclose(remove_dir=workdir)
        else:
            assert self.host.layout is not None
            cg = cgroups.Cgroup(self.host.layout, sandbox_id)
            with contextlib.suppress(Exception):
                await asyncio.to_thread(cg.remove)
            if workdir is not None:
                await asyncio.to_thread(remove_tree, workdir)

    def _from_state(self, sandbox_id: str, state: RuntimeState | None) -> NsSandbox | None:
        """The running sandbox, else the one its recorded ``state`` describes (after a restart)."""
        sbx = self.table.running.get(sandbox_id)
        if sbx is not None:
            return sbx
        if state is None or not state.data.get("cgroup") or self.host.layout is None:
            return None
        return NsSandbox.from_state(self.host.layout, state.data)

    def _from_state_file(self, sandbox_id: str) -> NsSandbox | None:
        """The sandbox as its own ``ns.json`` describes it. Needed when the server died after the
        runtime created the sandbox but before the store recorded its runtime state: without it the
        cgroup is killed but slirp4netns (outside the cgroup, and it does not exit with its netns)
        is orphaned."""
        path = self.host.settings.sandboxes_dir / sandbox_id / "ns" / STATE_FILE
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or not data.get("cgroup") or data.get("name") != sandbox_id \
                or self.host.layout is None:
            return None
        return NsSandbox.from_state(self.host.layout, data)

    async def adopt(self, sandbox_id: str, spec: SandboxSpec, state: RuntimeState, stopped: bool = False) -> bool:
        await self._start()
        layout = self.host.layout
        assert layout is not None
        if stopped:
            return await self._adopt_stopped(sandbox_id, spec, state)
        if not state.data.get("cgroup"):
            return False
        if state.data.get("dir") and await self.releaser.adopted(sandbox_id, Path(str(state.data["dir"]))):
            self.table.specs[sandbox_id] = spec
            return True
        sbx = NsSandbox.from_state(layout, state.data)
        if not sbx.alive() or not sbx.cgroup.exists():
            return False
        if await asyncio.to_thread(sbx.cgroup.frozen):
            self._schedule_release(sbx)
        if sbx.allow_internet and sbx.slirp is not None and not sbx.slirp.ref.alive():
            assert sbx.init is not None
            with contextlib.suppress(Exception):
                sbx.slirp = await Slirp.start(sbx.net_pid, key=sandbox_id, again=True)
                await asyncio.to_thread(sbx.write_state)
        if sbx.allow_internet and sbx.init is not None:
            sbx.egress.foreign = await foreign_rules(sbx.net_pid)
        self.table.add(sandbox_id, sbx, spec)
        return True

    async def _adopt_stopped(self, sandbox_id: str, spec: SandboxSpec, state: RuntimeState) -> bool:
        """After a restart, a sandbox the store says is paused without memory, or was being stopped or
        cold-started: end whatever of it still runs (the processes the store recorded, those its
        ``ns.json`` names: a cold start in flight, and its cgroup's members), keep its files."""
        layout = self.host.layout
        assert layout is not None
        root = Path(str(state.data.get("dir") or spec.workdir / "ns"))
        on_disk = await asyncio.to_thread(read_json, root / STATE_FILE)
        for data in (state.data, on_disk):
            if data.get("pid") and data.get("cgroup") and data.get("dir"):
                await NsSandbox.from_state(layout, data).stop()
        cg = cgroups.Cgroup(layout, sandbox_id)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(cg.kill_all)
            await asyncio.to_thread(cg.remove)
        if not (root / "upper").is_dir():
            return False
        recorded = {**on_disk, **state.data} if state.data.get("lowers") else {**state.data, **on_disk}
        data = {**recorded, "name": sandbox_id, "dir": str(root), "cgroup": sandbox_id, "pid": None,
                "start": None, "slirp": None, "stopped": True}
        data.pop("workdir", None)
        await asyncio.to_thread(_write_json, root / STATE_FILE, data)
        self.table.stopped[sandbox_id] = data
        self.table.specs[sandbox_id] = spec
        return True

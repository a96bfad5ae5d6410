"""A process tree CRIU restored, made a sandbox: its ``NsSandbox``, its network, envd ``/init``.

Every process restore ends here: a full snapshot's (new sandbox, fork child, rollback: ``snapshot.py``),
a template's process image (``procimage.py``) and a paused sandbox released to disk (``release.py``).
They get a ``Restorer`` from the runtime (with the host's facts and the sandbox table it registers
into), so none of them needs ``runtime.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from aenv.errors import RuntimeFailure
from aenv.runtime.base import SandboxSpec
from aenv.runtime.egress import ENFORCER
from aenv.runtime.envd_client import init_payload
from aenv.runtime.network import Slirp
from aenv.runtime.ns import cgroups, identity
from aenv.runtime.ns.host import NsHost
from aenv.runtime.ns.paths import Paths
from aenv.runtime.ns.sandbox import NsSandbox
from aenv.runtime.ns.table import NsTable
from aenv.runtime.process import ProcRef


class Restorer:
    """Before a restore: the sandbox it fills in and the hook that filters its network; after: ``attach``."""

    def __init__(self, host: NsHost, table: NsTable) -> None:
        self.host = host
        self.table = table

    def sandbox(self, spec: SandboxSpec, layers: tuple[str, ...], lowers: tuple[Path, ...],
                root: Path | None, stacked: bool = False, images: Path | None = None,
                own: bool = False) -> NsSandbox:
        """The ``NsSandbox`` a process restore fills in: ``spec``'s limits and network on the snapshot's
        layers. ``layers[0]`` is the snapshot's own upper: copied in as the sandbox's upper, or with
        ``stacked`` a lower like the others under a fresh upper (``NsSnapshots.restore_tree``). Its user
        namespace is the one the CRIU ``images`` were dumped in (``NsHost.userns_for_images``, ``own``
        there): InvalidRequest for another team's range, before anything is made."""
        host = self.host
        assert host.layout is not None
        userns = (host.userns_for_images(images, spec.uid_slot, own) if images is not None
                  else host.userns_at(spec.uid_slot))
        opts = replace(host.opts(replace(spec.template, lowers=lowers), spec.allow_internet,
                                 (spec.cpu_count, spec.memory_mb, spec.pids_limit), disk_mb=spec.disk_mb),
                       snapshot_layers=layers if stacked else layers[1:], zygote=None, volumes=spec.volumes,
                       userns=userns)
        return NsSandbox(spec.sandbox_id, Paths(root or spec.workdir / "ns"), cgroups.Cgroup(host.layout, spec.sandbox_id),
                         opts)

    def filter_while_restoring(self, sbx: NsSandbox, loop: asyncio.AbstractEventLoop) -> Callable[[int], None] | None:
        """For ``checkpoint.restore(on_netns=…)`` (called on the restore's thread): the sandbox's filter
        written into the fresh network namespace just before CRIU restores into it (the wrapper waits
        for it: a pid that may already have ended and been reused must never be written into); then
        ``attach(filtered=True)``. None: offline, or in a user namespace (``userns``): there the
        network namespace is the image's, made by CRIU inside the restored user namespace, so there is
        none before CRIU ends; ``attach`` writes the filter into the restored init's then,
        before slirp4netns gives it a tap (the dump left none in it), with the init checked to be the
        sandbox's before and after."""
        if not sbx.allow_internet or self.host.userns is not None:
            return None
        sid, host = sbx.name, self.host

        def install(pid: int) -> None:
            asyncio.run_coroutine_threadsafe(ENFORCER.install(sid, pid, host.host_addrs), loop).result(60)

        return install

    async def attach(self, sbx: NsSandbox, spec: SandboxSpec, pid: int, live: bool = True,
                     filtered: bool = False) -> None:
        """After ``criu restore``: record the init, give the fresh network namespace the sandbox's
        network (internet: filter, unless ``filtered`` during the restore, then slirp4netns), connect
        to the restored agent, ``/init`` envd with the new identity, and make the sandbox live.
        ``live=False`` (a pooled sandbox restored from a process image, ``procimage.py``): no ``/init``
        and not registered; the hand-out does both."""
        sid = spec.sandbox_id
        ref = ProcRef.of(pid)
        if ref is None:
            raise RuntimeFailure(f"sandbox {sid}: restored init {pid} exited at once", sandbox_id=sid)
        sbx.init = ref
        await asyncio.to_thread(sbx.write_state)
        if sbx.allow_internet:  # its policy in the filter before slirp gives the restored tree a way out
            if not filtered:
                await self._filter_restored(sbx, ref)
            sbx.slirp = await Slirp.start(pid, key=sbx.name)
            await asyncio.to_thread(sbx.write_state)
        await asyncio.to_thread(identity.set_hostname, pid, sid)  # CRIU brought back the parent's name
        await sbx._connect(wait=True)
        await sbx.health()
        if not live:
            return
        await sbx.init_envd(init_payload(spec))
        self.table.add(sid, sbx, spec)

    async def _filter_restored(self, sbx: NsSandbox, ref: ProcRef) -> None:
        """The filter into a restored init's network namespace after CRIU ended (a restore in a user
        namespace: ``filter_while_restoring``). Its pid must still name the sandbox's init, one of its
        cgroup's, before and after: a pid reused in between fails the restore, never filters another's."""
        def ours() -> bool:
            return ref.alive() and ref.pid in sbx.cgroup.pids()

        if not await asyncio.to_thread(ours):
            raise RuntimeFailure(f"sandbox {sbx.name}: restored init {ref.pid} ended before its filter",
                                 sandbox_id=sbx.name)
        await ENFORCER.install(sbx.name, ref.pid, self.host.host_addrs)
        if not await asyncio.to_thread(ours):
            raise RuntimeFailure(f"sandbox {sbx.name}: restored init {ref.pid} ended while filtered",
                                 sandbox_id=sbx.name)


_T = TypeVar("_T")


async def outlive_cancel(work: Awaitable[_T]) -> _T:
    """The result of ``work`` (a CRIU restore running in a thread). Cancelled meanwhile (the server
    stopping while a pool refill restores), it first waits for the thread to end, then raises the
    cancellation, so the caller's clean-up takes down what the thread made: CRIU goes on in its thread,
    and a tree restored after the clean-up ran was owned by no one (one such pool sandbox outlived its
    server)."""
    running = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            await running
        raise

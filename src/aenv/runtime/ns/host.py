"""The host-wide facts of one ``NsRuntime``, the launch options made of them, and the runtime's calls
its parts may make back.

Why a module of its own: every part (``lifecycle.py``, ``snapshot.py``, ``release.py``,
``procimage.py``, ``restored.py``) needs some of the cgroup layout, the tools bundle, the host's
addresses, the zygote, the user namespace, the disk quota and the CRIU status, most of them known
only once ``NsRuntime.start`` ran. The runtime makes one ``NsHost``, fills it in at start, and hands
it to each part's constructor; a part reads it when it acts. The two broad operations a part must
call back (start a sandbox ready to use; launch one under a temporary name) come in as callables of
the types below. So no part imports ``runtime.py``: the parts get what they need passed in, as vm's do.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, Protocol

from aenv.config import Settings
from aenv.errors import InvalidRequest, RuntimeFailure
from aenv.runtime import ksm
from aenv.runtime.base import RuntimeState, SandboxImage, SandboxSpec
from aenv.runtime.network import slirp_available
from aenv.runtime.ns import cgroups, checkpoint, criu
from aenv.runtime.ns.disk import POOL_NAME, DiskQuota
from aenv.runtime.ns.sandbox import LaunchOptions, NsSandbox
from aenv.runtime.ns.userns import SharedUserns, layer_dirs
from aenv.runtime.ns.zygote import Zygote
from aenv.runtime.tools import ensure_tools
from aenv.uid_ranges import host_base, slot_of

log = logging.getLogger("aenv.runtime.ns")

Start = Callable[[], Awaitable[None]]  # ``NsRuntime.start``: idempotent, before anything touches cgroups
# ``NsRuntime._prelaunch``: (name, root, spec, template, snapshot layers) -> a sandbox under a temporary name
Prelaunch = Callable[[str, Path, SandboxSpec, SandboxImage, tuple[str, ...]], Coroutine[Any, Any, NsSandbox]]


class LaunchReady(Protocol):
    """``NsRuntime._launch_ready``: ``spec`` started on ``template`` with ``snapshot_layers`` on top,
    envd initialised, the sandbox in the table (a cold start, a filesystem restore, a rollback)."""

    def __call__(self, spec: SandboxSpec, template: SandboxImage, snapshot_layers: tuple[str, ...], *,
                 root: Path | None = None, prelaunched: NsSandbox | None = None) -> Awaitable[RuntimeState]: ...


class NsHost:
    """What every ns sandbox of this server shares. ``layout``, ``tools``, ``host_addrs``, ``zygote``
    (and ``userns``, which ``check_userns`` may turn off) are set by ``NsRuntime.start``."""

    def __init__(self, settings: Settings, *, tools_dir: Path | None, debug_log: bool, launch_timeout: float) -> None:
        self.settings = settings
        self.debug_log = debug_log
        self.launch_timeout = launch_timeout
        self.tools_dir = tools_dir  # given by the caller: used as is, never rebuilt
        self.tools: Path | None = tools_dir
        self.zygote: Zygote | None = None
        self.layout: cgroups.Layout | None = None
        self.host_addrs: list[str] = []
        # on the same filesystem as the sandboxes: hand-out renames a pooled root into place
        self.pool_dir = settings.sandboxes_dir / POOL_NAME
        self.userns = SharedUserns(settings.ns_userns_uid) if settings.ns_userns_uid else None
        self.userns_off_reason = "" if self.userns is not None else "ns_userns_uid = 0"
        self._ranges: dict[int, SharedUserns] = {}  # the other uid ranges' namespaces, by slot (userns_at)
        self._ranges_lock = threading.Lock()
        self.disk = DiskQuota(settings.state_dir, settings.sandboxes_dir, enabled=settings.ns_disk_quota,
                              size_mb=settings.ns_volume_mb)
        self.mergeable = ksm.decide(settings).merge  # KSM may merge the sandboxes' pages (the ksm policy)

    # ---- what this host can do ------------------------------------------------------------------
    def criu_status(self) -> criu.CriuStatus:
        return criu.probe(settings=self.settings)

    def full_refusal(self, sbx: NsSandbox) -> str | None:
        """Why ``sbx``'s processes cannot be dumped here (snapshot mode full, release to disk), or None."""
        status = self.criu_status()
        if not status.usable:
            return f"process snapshots need CRIU >= 4.2 ({status.reason})"
        if sbx.from_zygote:
            return ("it was started from the zygote, whose preloaded files CRIU cannot map "
                    "(AENV_NS_ZYGOTE=1 with CRIU present)")
        if sbx.nested:
            return ("it runs Docker inside (dockerd, containerd and their containers in namespaces and mounts "
                    "of their own), which CRIU cannot dump on ns; the vm runtime forks and snapshots such sandboxes")
        return None

    def check_userns(self) -> None:
        """Keep the user namespace only where every launch can use it (``SharedUserns.unusable_on``):
        left at its default, a host that cannot runs sandboxes without one and says why (log, doctor,
        ``/aenv/info``); asked for explicitly, the server refuses to start. Blocking."""
        if self.userns is None:
            return
        s = self.settings
        why = self.userns.unusable_on(layer_dirs(s))
        if why is None:
            return
        if "ns_userns_uid" in s.model_fields_set:
            raise RuntimeError(f"ns_userns_uid = {s.ns_userns_uid} cannot be used here: {why}")
        log.warning("ns sandboxes run without a user namespace (root in them is host root in namespaces): %s", why)
        self.userns.close()
        self.userns, self.userns_off_reason = None, why

    # ---- uid ranges (aenv/uid_ranges.py) ----------------------------------------------------------
    def userns_at(self, slot: int) -> SharedUserns | None:
        """The user namespace of uid range ``slot`` (``SandboxSpec.uid_slot``; 0 is ``userns``), or
        None where sandboxes run without one. Made on first use: its fd when a launch asks for it.
        Every filesystem that takes one idmapped mount takes any other (``check_userns`` tried slot 0's)."""
        if self.userns is None or slot == 0:
            return self.userns
        with self._ranges_lock:
            ns = self._ranges.get(slot)
            if ns is None:
                try:
                    ns = self._ranges[slot] = SharedUserns(host_base(self.userns.host_uid, slot))
                except ValueError as exc:
                    raise RuntimeFailure(str(exc)) from exc
            return ns

    def ranges_in_use(self) -> list[int]:
        """The first host uid of every range a sandbox was started in since this server started."""
        if self.userns is None:
            return []
        with self._ranges_lock:
            return [self.userns.host_uid, *sorted(ns.host_uid for ns in self._ranges.values())]

    def userns_for_images(self, images: Path, slot: int, own: bool = False) -> SharedUserns | None:
        """The user namespace to restore CRIU ``images`` into for a sandbox of range ``slot``: processes
        cannot change range (CRIU makes their namespace again from the dumped map), so the images'.
        Images of the shared range (slot 0: a server with one team, or taken before teams had ranges
        of their own) restore there, as they always did. Another team's range (a published snapshot)
        is refused, unless ``own`` (a sandbox released to disk: its own processes, whatever its team's
        range is now). Images of no range of this server's are left to ``checkpoint.restore`` to refuse."""
        ns = self.userns_at(slot)
        base = checkpoint.dumped_userns(images)
        if ns is None or self.userns is None or base is None or base == ns.host_uid:
            return ns
        first = self.userns.host_uid
        if base in (0, first):
            return self.userns
        found = slot_of(first, base)
        if found is None:
            return ns
        if own:
            return self.userns_at(found)
        raise InvalidRequest(f"these processes were saved in another team's uid range (host uids {base}..); this "
                             f"team's sandboxes run in {ns.host_uid}.. and processes cannot move between ranges: "
                             "restore a filesystem snapshot of it instead (see docs/ARCHITECTURE.md, ns user namespace)")

    def close_ranges(self) -> None:
        """Drop the fds of every range's namespace (running sandboxes keep theirs alive themselves)."""
        with self._ranges_lock:
            for ns in self._ranges.values():
                ns.close()
            self._ranges.clear()
        if self.userns is not None:
            self.userns.close()

    def want_zygote(self) -> bool:
        """The zygote makes starts cheap, but CRIU cannot dump what it forks (its preloaded modules
        are mapped from the host's mount): with a usable CRIU sandboxes are started by exec, so every
        one can be snapshotted with its processes. AENV_NS_ZYGOTE=1/0 forces either way. Blocking."""
        if self.userns is not None:  # the zygote's in-process launch knows no user namespace
            return False
        forced = os.environ.get("AENV_NS_ZYGOTE")
        if forced in ("0", "1"):
            return forced == "1"
        return not self.criu_status().usable

    # ---- launching ------------------------------------------------------------------------------
    async def ensure_tools(self) -> None:
        """Rebuild the bundle if it vanished (another server's GC removed a superseded one)."""
        if self.tools_dir is None and (self.tools is None or not (self.tools / "MANIFEST.json").exists()):
            self.tools = await asyncio.to_thread(ensure_tools, self.settings)

    def opts(self, template: SandboxImage, allow_internet: bool, limits: tuple[int, int, int],
             pooled: bool = False, disk_mb: int | None = None, uid_slot: int = 0) -> LaunchOptions:
        """The launch options of a sandbox of ``template`` on this host, in uid range ``uid_slot``."""
        assert self.tools is not None
        if allow_internet and not slirp_available():
            raise RuntimeFailure("internet access needs slirp4netns and iptables on the host (apt-get install slirp4netns iptables)")
        if template.nested_containers and not self.settings.ns_nested_containers:
            raise InvalidRequest(
                f"template '{template.template_id}' runs Docker inside (nested_containers), which this ns node "
                "does not allow (ns_nested_containers is off): run such templates on the vm runtime",
                template=template.template_id)
        if template.nested_containers and self.userns is None:
            raise InvalidRequest(
                f"template '{template.template_id}' runs Docker inside (nested_containers), which an ns sandbox "
                "allows only in a user namespace of its own; this server runs them without one (ns_userns_uid=0)",
                template=template.template_id)
        return LaunchOptions(template=template, tools=self.tools, allow_internet=allow_internet,
                             default_limits=limits, debug_log=self.debug_log, pooled=pooled, zygote=self.zygote,
                             disk=self.disk if self.disk.active else None, userns=self.userns_at(uid_slot),
                             disk_mb=self.settings.default_disk_mb if disk_mb is None else disk_mb,
                             mergeable=self.mergeable, merge_idle_s=self.settings.ksm_idle_s)

    def pool_opts(self, template: SandboxImage, allow_internet: bool, uid_slot: int = 0) -> LaunchOptions:
        """A pool entry's (or a process image's) options: the default limits, the lowest CPU weight."""
        s = self.settings
        return self.opts(template, allow_internet, (s.default_cpu_count, s.default_memory_mb, s.pids_limit),
                         pooled=True, uid_slot=uid_slot)

    async def launch(self, name: str, root: Path, opts: LaunchOptions, keep_root: bool = False) -> NsSandbox:
        """Start a sandbox by exec (or the zygote) under ``name`` in ``root`` (``NsSandbox.launch``)."""
        assert self.layout is not None
        return await NsSandbox.launch(name, root, self.layout, opts, self.host_addrs, timeout=self.launch_timeout,
                                      keep_root=keep_root)

"""``aenv doctor``: what this host can do, and why — runtimes, accelerator, cgroups, CRIU, disk quota."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from aenv.config import Settings


def _cgroup_mode() -> str:
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():
        return "v2 (unified)"
    if Path("/sys/fs/cgroup/memory").is_dir():
        return "v1 (hybrid)" if Path("/sys/fs/cgroup/unified").is_dir() else "v1"
    return "none found"


def _criu(settings: Settings) -> str:
    """The same detection the ns runtime uses (the set-up's build, ``criu --version`` >= 4.2 and
    ``criu check``)."""
    from aenv.runtime.ns.criu import probe

    st = probe(settings=settings)
    if st.usable:
        return f"{st.describe()}: ns snapshots, fork and rollback keep processes"
    return f"{st.reason}; ns snapshots, fork and rollback are filesystem-only (scripts/build-criu.sh builds it)"


def _disk_quota(settings: Settings) -> str:
    """The same volume the ns runtime uses (``disk.py``): the live one, or a real trial of it."""
    from aenv.runtime.ns.disk import probe

    return probe(settings.state_dir, settings.sandboxes_dir, settings.ns_disk_quota, settings.ns_volume_mb)


def _userns(settings: Settings) -> str:
    """The same trial the ns runtime makes at start (``NsHost.check_userns``)."""
    from aenv.runtime.ns.userns import SharedUserns, layer_dirs

    if not settings.ns_userns_uid:
        return "off (ns_userns_uid = 0): root in an ns sandbox is host root in namespaces"
    if os.geteuid() != 0:
        return "needs root to check"
    userns = SharedUserns(settings.ns_userns_uid)
    try:
        why = userns.unusable_on(layer_dirs(settings))
    finally:
        userns.close()
    if why is None:
        return (f"on: uids 0-65535 in an ns sandbox are host uids {settings.ns_userns_uid}.., or, with two or more "
                "teams, those of a 65536-uid range of the team's own above it")
    return f"unusable ({why}): ns sandboxes run without one"


def _lazy(settings: Settings) -> str:
    from aenv.images.lazy.lazyd import fuse_support

    why = fuse_support()
    if why is not None:
        return f"unavailable ({why}): images are pulled whole"
    if not settings.lazy_images:
        return "available, off (lazy_images = false): images are pulled whole"
    return f"on: started on demand through aenv-lazyd (FUSE), chunk cache {settings.lazy_cache_bytes / 2**30:.1f} GiB"


def _qemu() -> str:
    """Where QEMU is and which release (vm snapshots record it: they restore only under the same one)."""
    path = shutil.which("qemu-system-x86_64")
    if path is None:
        return "absent"
    from aenv.runtime.vm.compat import qemu_version

    return f"{path} (QEMU {qemu_version()})"  # the release the runtime's snapshots and templates record


def _ksm(settings: Settings) -> str:
    from aenv.runtime import ksm

    stat = ksm.stats(ksm.decide(settings))
    line = ("sandboxes merged: " if stat["merge"] else "sandboxes not merged: ") + str(stat["reason"])
    if "running" not in stat:
        return line + "; this kernel has no KSM"
    host = "running" if stat["running"] else "stopped (a server that merges starts it)"
    return (line + f"; host ksmd {host}, {stat['mergedBytes'] / 2**20:.0f} MiB merged, "
            f"{(stat['profitBytes'] or 0) / 2**20:.0f} MiB saved, ksmd CPU {stat['ksmdCpuSeconds'] or 0:.1f} s")


def _private_egress(settings: Settings) -> str:
    """The allowlist as the server would enforce it (host names resolved now), or why it would not start."""
    from aenv.runtime import allowlist

    try:
        allowed = allowlist.parse(settings.private_egress, settings.service_ports, allowlist.resolve_on_host)
    except allowlist.AllowlistError as exc:
        return f"invalid, the server will not start: {exc}"
    if allowed.empty:
        return "none (private_egress empty): sandboxes reach no private range and not the host"
    return "; ".join(f"{d['entry']} → {d['reach']} ({'every sandbox' if d['sandboxes'] == 'all' else 'named in allowOut'})"
                     for d in allowed.describe())


def _bandwidth(settings: Settings) -> str:
    """The default limits and whether this host can enforce them (tc tried in a throwaway namespace)."""
    from aenv.runtime.shaping import probe

    egress, ingress = settings.default_bandwidth()
    default = (f"default egress {egress or 'unlimited'}, ingress {ingress or 'unlimited'} Mbit/s"
               + (f", max {settings.max_bandwidth_mbit}" if settings.max_bandwidth_mbit else ""))
    if os.geteuid() != 0:
        return f"{default} (needs root to check)"
    why = probe()
    return f"{default}; {'enforceable (tc tbf, ifb)' if why is None else why}"


def collect(settings: Settings) -> dict[str, Any]:
    from aenv.runtime.select import auto_choice, vm_unavailable_reason

    vm_reason = vm_unavailable_reason(settings)
    auto, auto_why = auto_choice(settings)
    report: dict[str, Any] = {
        "kernel": os.uname().release,
        "root": os.geteuid() == 0,
        "cgroups": _cgroup_mode(),
        "overlayfs": "yes" if "overlay" in Path("/proc/filesystems").read_text() else "no",
        "ns runtime": "usable" if os.geteuid() == 0 else "needs root",
        "vm runtime": "usable" if vm_reason is None else f"unavailable: {vm_reason}",
        "auto picks": f"{auto}: {auto_why}",
        "qemu": _qemu(),
        "criu": _criu(settings),
        "ns disk quota": _disk_quota(settings),
        "ns user namespace": _userns(settings),
        "lazy images": _lazy(settings),
        "ksm": _ksm(settings),
        "private egress": _private_egress(settings),
        "bandwidth limits": _bandwidth(settings),
        "package mirrors": ", ".join(f"{k} {v}" for k, v in sorted(settings.package_mirrors.items())) or "none",
        "isolation note": "ns sandboxes share the host kernel (weaker isolation than vm); see docs/security.md",
        "state dir": str(settings.state_dir),
        "cache dir": str(settings.cache_dir),
    }
    try:
        from aenv.runtime.vm.accel import probe

        choice = probe()
        report["accelerator"] = f"{choice.name}: {choice.reason}"
    except Exception as exc:  # the VM package may not exist yet or the probe may fail
        report["accelerator"] = f"unknown ({type(exc).__name__})"
    return report

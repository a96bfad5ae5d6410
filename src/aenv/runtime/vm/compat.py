"""This host's machine record (``aenv.machine_key``) and the check every restore makes first.

What a guest's saved state depends on:

* the accelerator: ``kvm`` or ``tcg`` (``accel.py``);
* the CPU the guest saw: under TCG ``-cpu max``, what this QEMU emulates (so ``"max"``, and the QEMU
  version says the rest); under KVM ``-cpu host``, the host's own CPU: its ``model name`` from
  /proc/cpuinfo and a short hash of its feature flags (one model name covers several steppings and
  microcode levels);
* the QEMU release, major.minor (``qemu-system-x86_64 --version``, asked once per process): the
  microvm machine type is not versioned, so another minor release may lay devices out differently;
  stable patch releases keep the migration format.

:func:`check` raises ``MachineMismatch`` when a record differs from this host's; state without a
record (snapshots taken before records existed) passes, as before.
"""

from __future__ import annotations

import functools
import hashlib
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aenv.errors import MachineMismatch
from aenv.machine_key import MachineKey, compatible, describe, parse

from .config import Accel

RECORD = "machine"  # the key of the record in a snapshot's data and a released pause's marker

_VERSION = re.compile(r"QEMU emulator version (\d+)\.(\d+)")


def parse_qemu_version(text: str) -> str | None:
    """``7.2`` from ``QEMU emulator version 7.2.22 (Debian ...)``; None when it says no version."""
    m = _VERSION.search(text)
    return f"{m.group(1)}.{m.group(2)}" if m else None


@functools.cache
def qemu_version(binary: str = "qemu-system-x86_64") -> str:
    """This host's QEMU release (major.minor), asked once per process; ``unknown`` if it does not say."""
    try:
        out = subprocess.run([binary, "--version"], check=False, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return parse_qemu_version(out) or "unknown"


def cpu_model(accel: Accel, cpuinfo: str) -> str:
    """The CPU the guest sees: ``max`` under TCG; under KVM the host's model name and a hash of its
    flags (``AMD EPYC 7B13 #1a2b3c4d``)."""
    if accel == "tcg":
        return "max"
    model = flags = ""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "model name" and not model:
            model = value.strip()
        elif name.strip() == "flags" and not flags:
            flags = " ".join(sorted(value.split()))
    digest = hashlib.sha256(flags.encode()).hexdigest()[:8]
    return f"{model or 'unknown'} #{digest}"


def machine_key(accel: Accel, cpuinfo: str, qemu: str) -> MachineKey:
    return {"accel": accel, "cpu": cpu_model(accel, cpuinfo), "qemu": qemu}


def host_key(accel: Accel, cpuinfo_path: Path = Path("/proc/cpuinfo")) -> MachineKey:
    """This host's record under ``accel`` (blocking: reads /proc/cpuinfo, asks QEMU once)."""
    try:
        cpuinfo = cpuinfo_path.read_text()
    except OSError:
        cpuinfo = ""
    return machine_key(accel, cpuinfo, qemu_version())


def recorded(data: Mapping[str, Any]) -> MachineKey | None:
    """The record in a snapshot's data (or a released pause's marker), if it has one."""
    return parse(data.get(RECORD))


def check(data: Mapping[str, Any], here: MachineKey | None, what: str, **context: Any) -> None:
    """Raise ``MachineMismatch`` when ``data`` records another machine than ``here``."""
    rec = recorded(data)
    if rec is not None and not compatible(rec, here):
        raise MachineMismatch(
            f"{what} was taken on {describe(rec)} and cannot be restored on this node ({describe(here)}): "
            "restore it on a node with the same machine", rec, here, **context,
        )  # fmt: skip

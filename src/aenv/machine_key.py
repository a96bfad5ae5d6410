"""The machine a saved VM state restores on, as a small record every layer can compare (shared words).

A vm snapshot (and a VM paused to disk) holds vCPU and device state that only a QEMU presenting the
same virtual machine can load: the same accelerator, the same CPU model as the guest saw it, and the
same QEMU release. The record is three strings, e.g. ``{"accel": "tcg", "cpu": "max", "qemu": "7.2"}``
(``runtime/vm/compat.py`` probes this host's; nodes report it in ``/aenv/info`` and snapshots show
theirs). Two records are compatible when they are equal; a snapshot without one (taken before records
existed) restores anywhere, as it always did.
"""

from __future__ import annotations

from typing import Any

MachineKey = dict[str, str]

FIELDS = ("accel", "cpu", "qemu")


def parse(value: Any) -> MachineKey | None:
    """A well-formed record (exactly the three fields, non-empty strings), or None for anything else."""
    if not isinstance(value, dict) or set(value) != set(FIELDS):
        return None
    if not all(isinstance(value[f], str) and value[f] for f in FIELDS):
        return None
    return {f: str(value[f]) for f in FIELDS}


def compatible(recorded: MachineKey | None, here: MachineKey | None) -> bool:
    """Whether state recorded on ``recorded`` restores on ``here``: no record restores anywhere; a
    record needs a machine that is known and the same."""
    return recorded is None or (here is not None and recorded == here)


def describe(key: MachineKey | None) -> str:
    """One readable phrase for messages: ``tcg, cpu max, QEMU 7.2`` (``unknown machine`` for None)."""
    if key is None:
        return "unknown machine"
    return f"{key['accel']}, cpu {key['cpu']}, QEMU {key['qemu']}"

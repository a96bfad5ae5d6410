"""What one QEMU microVM process looks like, as plain immutable data.

The command line is derived from this by :func:`aenv.runtime.vm.cmdline.build_argv` and nothing
else, so two processes built from configs that differ only in ``mem_share``/``incoming``/paths can
exchange device state (a snapshot taken by one restores in the other). Everything that changes the
guest-visible device list or machine shape is a field here, which makes "is this snapshot
compatible?" a comparison of :meth:`VmConfig.shape`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

Accel = Literal["tcg", "kvm"]
Network = Literal["user", "restricted", "none"]
DiskFormat = Literal["qcow2", "raw"]


MAX_SOCKET_PATH = 108  # sizeof(sun_path), including the terminating NUL


class VmConfigError(ValueError):
    """A config that cannot describe a runnable VM (the message names the field)."""


@dataclass(frozen=True)
class Drive:
    """One virtio-blk disk. ``serial`` is how the guest finds it (``/sys/block/vdX/serial``):
    virtio-mmio probe order decides vda/vdb, so the guest never relies on names."""

    path: Path
    serial: str
    format: DiskFormat = "qcow2"
    read_only: bool = False
    # True: QEMU never fsyncs this image (``cache=unsafe``). For a sandbox's own overlays: they
    # live as long as the host's page cache does anyway (a host reboot ends the VM), and a disk
    # checkpoint in a snapshot otherwise waits 10-50 ms for the old top image to be synced.
    no_flush: bool = False

    @property
    def node_name(self) -> str:
        """Block node (what ``blockdev-snapshot-sync`` names)."""
        return f"disk-{self.serial}"

    @property
    def drive_id(self) -> str:
        """Block backend id (must differ from every node name)."""
        return f"drive-{self.serial}"


@dataclass(frozen=True)
class VmConfig:
    """One QEMU process. Paths are absolute and owned by whoever owns the VM object."""

    name: str
    kernel: Path
    qmp_socket: Path
    channel_socket: Path  # virtio-serial port, the host side of the agent channel (server socket)
    mem_path: Path  # guest RAM file, normally in /dev/shm
    initrd: Path | None = None
    serial_log: Path | None = None  # guest console (ttyS0); None = discard
    mem_share: bool = True  # True: template/boot (MAP_SHARED); False: restore/fork (MAP_PRIVATE, CoW)
    memory_mb: int = 512
    cpu_count: int = 1
    accel: Accel = "tcg"
    tsc_khz: int | None = None  # passed as tsc_early_khz; needed under TCG (notes/vmm.md §2)
    drives: tuple[Drive, ...] = ()
    network: Network = "user"
    mac: str = "52:54:00:12:34:56"
    balloon: bool = True
    rng: bool = True
    incoming: bool = False  # start with -S -incoming defer, waiting for migrate-incoming
    start_paused: bool = False  # -S without incoming (e.g. to attach before the guest runs)
    append: tuple[str, ...] = ()  # extra kernel command-line words
    qemu_binary: str = "qemu-system-x86_64"
    channel_name: str = "aenv"  # must match initramfs.CHANNEL_NAME
    # False: the process reads migration streams without a configuration section, i.e. device
    # state saved by ``xen-save-devices-state`` (a layered snapshot). Not part of the shape.
    send_configuration: bool = True
    # The 9p export the guest mounts its E2B volumes from (runtime/vm/volumes.py): a template's
    # empty, read-only directory, or a sandbox's own export of its volume binds. None: no device
    # (configs saved before volumes existed restore as they were).
    share_dir: Path | None = None
    share_read_only: bool = True
    # KSM may merge the guest's RAM (QEMU's ``mem-merge``, on by default; off where the ``ksm`` policy
    # says tenants must not share pages, ``runtime/ksm.py``)
    mem_merge: bool = True

    def __post_init__(self) -> None:
        if self.memory_mb < 64:
            raise VmConfigError(f"memory_mb={self.memory_mb}: at least 64 MiB")
        if not 1 <= self.cpu_count <= 16:  # NR_CPUS=16 in the guest kernel
            raise VmConfigError(f"cpu_count={self.cpu_count}: 1..16")
        if self.accel not in ("tcg", "kvm"):
            raise VmConfigError(f"accel={self.accel!r}")
        if self.network not in ("user", "restricted", "none"):
            raise VmConfigError(f"network={self.network!r}")
        serials = [d.serial for d in self.drives]
        if len(set(serials)) != len(serials):
            raise VmConfigError(f"drive serials must be unique: {serials}")
        for d in self.drives:
            if not d.serial.replace("-", "").isalnum() or len(d.serial) > 20:
                raise VmConfigError(f"drive serial {d.serial!r}: alphanumerics and '-', at most 20")
        for sock in (self.qmp_socket, self.channel_socket):
            if len(str(sock).encode()) >= MAX_SOCKET_PATH:
                raise VmConfigError(
                    f"socket path {sock} is longer than {MAX_SOCKET_PATH - 1} bytes (AF_UNIX limit)"
                )
        for w in self.append:
            if not w or any(c.isspace() for c in w):
                raise VmConfigError(f"append word {w!r} must be non-empty without spaces")

    def shape(self) -> tuple[object, ...]:
        """What must be equal between the snapshotting and the restoring process.

        Includes the device list and kernel command line (the guest saw it at boot), excludes
        per-process paths, sharing mode and start mode.
        """
        return (
            self.memory_mb,
            self.cpu_count,
            self.accel,
            self.tsc_khz,
            tuple((d.serial, d.format, d.read_only) for d in self.drives),
            self.network != "none",
            self.mac,
            self.balloon,
            self.rng,
            self.append,
            self.channel_name,
            self.share_dir is not None,
        )

    def for_restore(self, **changes: object) -> VmConfig:
        """The config of a process that restores a snapshot of this one: private RAM, waiting."""
        merged: dict[str, object] = {"mem_share": False, "incoming": True, "start_paused": False}
        merged.update(changes)
        return replace(self, **merged)  # type: ignore[arg-type]


def config_to_json(cfg: VmConfig) -> dict[str, Any]:
    """A JSON-safe dict (paths as strings) that :func:`config_from_json` turns back into ``cfg``."""
    return json.loads(json.dumps(asdict(cfg), default=str))  # type: ignore[no-any-return]


def config_from_json(raw: dict[str, Any]) -> VmConfig:
    data = dict(raw)
    data["drives"] = tuple(
        Drive(Path(d["path"]), d["serial"], d["format"], d["read_only"], d.get("no_flush", False))
        for d in data.get("drives", ())
    )
    for k in ("kernel", "initrd", "qmp_socket", "channel_socket", "serial_log", "mem_path", "share_dir"):
        if data.get(k) is not None:
            data[k] = Path(data[k])
    data["append"] = tuple(data.get("append", ()))
    return VmConfig(**data)


def default_append() -> tuple[str, ...]:
    """Kernel words every aenv guest gets (before ``VmConfig.append``)."""
    return ("console=ttyS0", "quiet", "panic=-1", "reboot=t", "random.trust_cpu=on")


def accel_append(accel: str, guest_aslr: bool = False) -> tuple[str, ...]:
    """Kernel words that depend on the accelerator, kept in the template's ``VmConfig.append``.

    Under TCG, measured in a 2-vCPU guest (QEMU CPU time per ``/bin/true`` fork+exec, 108 → 27 ms):

    * ``norandmaps``: QEMU 7.2 looks translated code up by virtual *and* physical address, so with
      ASLR every new process maps ld.so/libc/bash somewhere new and TCG translates them again.
      Without it, every process reuses the blocks the previous one translated. ASLR inside a
      one-tenant sandbox protects little; ``vm_guest_aslr = true`` keeps it.
    * ``tsc=reliable``: the TSC sync check fails between TCG vCPUs, the guest then falls back to
      the jiffies clocksource (no vDSO clock, 4 ms resolution).
    * ``mitigations=off``: speculative-execution barriers only cost emulation time under TCG.

    Under KVM none of this applies and the guest keeps its defaults.
    """
    if accel != "tcg":
        return ()
    words = ["tsc=reliable", "mitigations=off"]
    if not guest_aslr:
        words.append("norandmaps")
    return tuple(words)

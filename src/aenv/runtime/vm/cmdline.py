"""Pure QEMU command-line builder: :class:`VmConfig` in, argv out. No I/O, fully unit-tested.

The machine is ``-M microvm`` with ACPI and option ROMs off (the guest kernel finds its
virtio-mmio devices on the command line QEMU appends), RAM in a ``memory-backend-file`` so
snapshots can skip it (``x-ignore-shared``), and only virtio devices: blk, serial, rng, balloon,
net, and the 9p export of E2B volumes (the eighth and last virtio-mmio transport microvm has). Network ``restricted`` keeps the NIC (so snapshots stay compatible) but cuts it off.
"""

from __future__ import annotations

from aenv.agent.volumes import TAG

from .config import Drive, VmConfig, default_append

SHARE_TAG = TAG  # the 9p mount tag the guest agent mounts


def _kv(*parts: str, **opts: object) -> str:
    """``a,b,k=v`` with booleans as on/off, in the given order."""
    out = list(parts)
    for k, v in opts.items():
        if v is None:
            continue
        if isinstance(v, bool):
            v = "on" if v else "off"
        out.append(f"{k.replace('_', '-')}={_escape(str(v))}")
    return ",".join(out)


def _escape(value: str) -> str:
    """QEMU option values double a literal comma."""
    return value.replace(",", ",,")


def kernel_append(cfg: VmConfig) -> str:
    words = list(default_append())
    if cfg.tsc_khz:
        words.append(f"tsc_early_khz={cfg.tsc_khz}")
    if cfg.network != "none":
        # Static address on QEMU's slirp network: no DHCP client needed in the guest.
        words.append("ip=10.0.2.15::10.0.2.2:255.255.255.0::eth0:off")
    words.extend(cfg.append)
    return " ".join(words)


def _drive_args(d: Drive) -> list[str]:
    drive = _kv(
        f"file={_escape(str(d.path))}",
        "if=none",
        format=d.format,
        id=d.drive_id,
        node_name=d.node_name,
        readonly=d.read_only,
        cache="unsafe" if d.no_flush and not d.read_only else "writeback",
        discard=None if d.read_only else "unmap",
    )
    return ["-drive", drive, "-device", _kv("virtio-blk-device", drive=d.drive_id, serial=d.serial)]


def build_argv(cfg: VmConfig) -> list[str]:
    """The full argv (argv[0] is the QEMU binary) for one VM process."""
    mem = f"{cfg.memory_mb}M"
    argv = [
        cfg.qemu_binary,
        "-name", f"{cfg.name},debug-threads=on",
        "-M", _kv("microvm", x_option_roms=False, acpi=False, memory_backend="mem",
                  mem_merge=None if cfg.mem_merge else False),
        "-accel", cfg.accel,
        "-cpu", "max" if cfg.accel == "tcg" else "host",
        "-m", mem,
        "-smp", str(cfg.cpu_count),
        "-object", _kv("memory-backend-file", id="mem", size=mem, mem_path=str(cfg.mem_path), share=cfg.mem_share),
        "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
        "-kernel", str(cfg.kernel),
        "-append", kernel_append(cfg),
    ]  # fmt: skip
    if cfg.initrd is not None:
        argv += ["-initrd", str(cfg.initrd)]
    if cfg.serial_log is not None:
        argv += ["-chardev", _kv("file", id="con", path=str(cfg.serial_log)), "-serial", "chardev:con"]
    else:
        argv += ["-serial", "null"]
    argv += ["-qmp", _kv(f"unix:{_escape(str(cfg.qmp_socket))}", server=True, wait=False)]
    for d in cfg.drives:
        argv += _drive_args(d)
    argv += [
        "-device", "virtio-serial-device,max_ports=2",
        "-chardev", _kv("socket", id="chan", path=str(cfg.channel_socket), server=True, wait=False),
        "-device", _kv("virtserialport", chardev="chan", name=cfg.channel_name, nr=1),
    ]  # fmt: skip
    if cfg.rng:
        argv += ["-object", "rng-random,id=rng,filename=/dev/urandom", "-device", "virtio-rng-device,rng=rng"]
    if cfg.balloon:
        argv += ["-device", "virtio-balloon-device,free-page-reporting=on,deflate-on-oom=on"]
    if cfg.network != "none":
        argv += [
            "-netdev", _kv("user", id="net", restrict=cfg.network == "restricted"),
            "-device", _kv("virtio-net-device", netdev="net", mac=cfg.mac),
        ]  # fmt: skip
    if cfg.share_dir is not None:
        # passthrough: the guest's owners and modes are the files' own on the host, as ns shows
        # them; the export's binds are nodev,nosuid (volumes.py), so a node the guest makes there
        # opens nothing on the host. remap: the binds are other filesystems (no inode clashes).
        argv += [
            "-fsdev", _kv("local", "security_model=passthrough", id="share", path=str(cfg.share_dir),
                          multidevs="remap", readonly=cfg.share_read_only),
            "-device", _kv("virtio-9p-device", "fsdev=share", f"mount_tag={SHARE_TAG}"),
        ]  # fmt: skip
    if not cfg.send_configuration:
        argv += ["-global", "migration.send-configuration=off"]
    if cfg.incoming:
        argv += ["-S", "-incoming", "defer"]
    elif cfg.start_paused:
        argv += ["-S"]
    return argv

"""The pure command-line builder and the config checks it relies on."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.runtime.vm.cmdline import build_argv, kernel_append
from aenv.runtime.vm.config import Drive, VmConfig, VmConfigError, config_from_json, config_to_json


def _cfg(**kw: object) -> VmConfig:
    base: dict[str, object] = {
        "name": "sb1",
        "kernel": Path("/k/bzImage"),
        "qmp_socket": Path("/run/sb1/qmp.sock"),
        "channel_socket": Path("/run/sb1/chan.sock"),
        "mem_path": Path("/dev/shm/aenv/tpl.mem"),
        "tsc_khz": 2100000,
    }
    base.update(kw)
    return VmConfig(**base)  # type: ignore[arg-type]


def _opt(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_tcg_defaults() -> None:
    argv = build_argv(_cfg())
    assert argv[0] == "qemu-system-x86_64"
    assert _opt(argv, "-M") == ["microvm,x-option-roms=off,acpi=off,memory-backend=mem"]
    assert _opt(argv, "-accel") == ["tcg"] and _opt(argv, "-cpu") == ["max"]
    assert _opt(argv, "-m") == ["512M"] and _opt(argv, "-smp") == ["1"]
    assert "memory-backend-file,id=mem,size=512M,mem-path=/dev/shm/aenv/tpl.mem,share=on" in _opt(
        argv, "-object"
    )
    assert _opt(argv, "-qmp") == ["unix:/run/sb1/qmp.sock,server=on,wait=off"]
    assert "socket,id=chan,path=/run/sb1/chan.sock,server=on,wait=off" in _opt(argv, "-chardev")
    assert "virtserialport,chardev=chan,name=aenv,nr=1" in _opt(argv, "-device")
    assert "virtio-rng-device,rng=rng" in _opt(argv, "-device")
    assert "virtio-balloon-device,free-page-reporting=on,deflate-on-oom=on" in _opt(argv, "-device")
    assert _opt(argv, "-serial") == ["null"]
    assert "-S" not in argv and "-incoming" not in argv
    for flag in ("-nodefaults", "-no-user-config", "-no-reboot"):
        assert flag in argv


def test_append_has_tsc_and_static_ip() -> None:
    cmd = kernel_append(_cfg(append=("rdinit=/init",)))
    assert "console=ttyS0" in cmd and "tsc_early_khz=2100000" in cmd
    assert "ip=10.0.2.15::10.0.2.2:255.255.255.0::eth0:off" in cmd
    assert cmd.endswith("rdinit=/init")
    assert "tsc_early_khz" not in kernel_append(_cfg(tsc_khz=None))
    assert "ip=" not in kernel_append(_cfg(network="none"))


def test_kvm_uses_host_cpu() -> None:
    argv = build_argv(_cfg(accel="kvm", tsc_khz=None))
    assert _opt(argv, "-accel") == ["kvm"] and _opt(argv, "-cpu") == ["host"]


def test_restore_is_private_and_deferred() -> None:
    tpl = _cfg(initrd=Path("/k/initrd.gz"), serial_log=Path("/run/sb1/console.log"))
    child = tpl.for_restore(name="c1", qmp_socket=Path("/run/c1/qmp"), channel_socket=Path("/run/c1/chan"))
    argv = build_argv(child)
    assert any(o.endswith("share=off") for o in _opt(argv, "-object") if o.startswith("memory-backend-file"))
    assert argv[-3:] == ["-S", "-incoming", "defer"]
    assert _opt(argv, "-initrd") == ["/k/initrd.gz"]
    assert _opt(argv, "-serial") == ["chardev:con"]
    assert child.shape() == tpl.shape()
    assert build_argv(_cfg(start_paused=True))[-1] == "-S"


def test_drives_by_serial() -> None:
    argv = build_argv(
        _cfg(
            drives=(Drive(Path("/sb/root.qcow2"), "root"), Drive(Path("/t/tools.img"), "tools", "raw", True))
        )
    )
    drives = _opt(argv, "-drive")
    assert drives[0] == (
        "file=/sb/root.qcow2,if=none,format=qcow2,id=drive-root,node-name=disk-root,readonly=off,"
        "cache=writeback,discard=unmap"
    )
    assert (
        drives[1].startswith("file=/t/tools.img,if=none,format=raw,id=drive-tools")
        and "readonly=on" in drives[1]
    )
    assert "virtio-blk-device,drive=drive-root,serial=root" in _opt(argv, "-device")


def test_sandbox_overlay_is_never_synced() -> None:
    """A sandbox's own root overlay (child_config) is cache=unsafe: a snapshot's disk checkpoint
    would otherwise wait for the old top image to be synced. Templates keep writeback."""
    from aenv.runtime.vm.sandbox import child_config

    tpl = _cfg(drives=(Drive(Path("/t/disk.qcow2"), "root"), Drive(Path("/t/tools.img"), "tools", "raw", True)))
    child = child_config(tpl, "sb", Path("/run/sb"), allow_internet=True)
    root, tools = child.drives
    assert root.no_flush and root.path == Path("/run/sb/root.qcow2") and not tools.no_flush
    drives = _opt(build_argv(child), "-drive")
    assert "cache=unsafe" in drives[0] and "cache=writeback" in drives[1]
    assert "cache=writeback" in _opt(build_argv(tpl), "-drive")[0]
    assert child.shape() == tpl.shape()  # the cache mode is no part of what a restore must match
    assert config_from_json(config_to_json(child)) == child


def test_comma_in_path_is_escaped() -> None:
    argv = build_argv(_cfg(drives=(Drive(Path("/a,b/root.qcow2"), "root"),)))
    assert _opt(argv, "-drive")[0].startswith("file=/a,,b/root.qcow2,")


def test_network_modes() -> None:
    assert "user,id=net,restrict=off" in _opt(build_argv(_cfg()), "-netdev")
    assert "user,id=net,restrict=on" in _opt(build_argv(_cfg(network="restricted")), "-netdev")
    none = build_argv(_cfg(network="none"))
    assert "-netdev" not in none and not any("virtio-net" in d for d in _opt(none, "-device"))
    # restricted keeps the NIC, so a snapshot from an open template restores into it
    assert _cfg(network="restricted").shape() == _cfg().shape() != _cfg(network="none").shape()


def test_optional_devices_off() -> None:
    devs = _opt(build_argv(_cfg(rng=False, balloon=False)), "-device")
    assert not any("rng" in d or "balloon" in d for d in devs)


@pytest.mark.parametrize(
    "kw",
    [
        {"memory_mb": 32},
        {"cpu_count": 0},
        {"cpu_count": 17},
        {"accel": "hvf"},
        {"network": "bridge"},
        {"append": ("a b",)},
        {"drives": (Drive(Path("/a"), "x"), Drive(Path("/b"), "x"))},
        {"drives": (Drive(Path("/a"), "bad serial"),)},
        {"qmp_socket": Path("/" + "x" * 120)},
    ],
)
def test_invalid_configs(kw: dict[str, object]) -> None:
    with pytest.raises(VmConfigError):
        _cfg(**kw)


def test_volume_export_is_the_last_device() -> None:
    """The 9p export takes the last virtio-mmio transport (the other devices keep their slots, so
    older snapshots' layouts are unchanged) and is read-only unless the sandbox has its own."""
    argv = build_argv(_cfg(share_dir=Path("/tpl/share")))
    assert _opt(argv, "-fsdev") == ["local,security_model=passthrough,id=share,path=/tpl/share,multidevs=remap,readonly=on"]
    assert _opt(argv, "-device")[-1] == "virtio-9p-device,fsdev=share,mount_tag=aenv-volumes"
    rw = build_argv(_cfg(share_dir=Path("/exports/sb1"), share_read_only=False))
    assert _opt(rw, "-fsdev")[0].endswith("readonly=off")
    assert "-fsdev" not in build_argv(_cfg())
    assert _cfg(share_dir=Path("/a")).shape() == _cfg(share_dir=Path("/b"), share_read_only=False).shape()
    assert _cfg(share_dir=Path("/a")).shape() != _cfg().shape()
    assert config_from_json(config_to_json(_cfg(share_dir=Path("/a")))).share_dir == Path("/a")

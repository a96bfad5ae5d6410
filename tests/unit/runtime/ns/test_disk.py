"""The pure parts of the ns disk quota (``aenv.runtime.ns.disk``): ioctl numbers and struct packing
(checked against linux/btrfs.h), mountinfo parsing, sizing, and the no-quota paths."""

from __future__ import annotations

import struct
import uuid
from pathlib import Path

import pytest

from aenv.runtime.ns import disk


def test_ioctl_numbers_match_linux_btrfs_h() -> None:
    # printed by a C program including <linux/btrfs.h> (BTRFS_IOC_*)
    assert disk.SUBVOL_CREATE == 0x5000940E
    assert disk.SNAP_DESTROY == 0x5000940F
    assert disk.INO_LOOKUP == 0xD0009412
    assert disk.FS_INFO == 0x8400941F
    assert disk.QUOTA_CTL == 0xC0109428
    assert disk.QGROUP_LIMIT == 0x8030942B


def test_vol_args_layout() -> None:
    buf = disk.vol_args("pool-abc")
    assert isinstance(buf, bytearray) and len(buf) == 4096  # sizeof(struct btrfs_ioctl_vol_args)
    assert struct.unpack_from("=q", buf)[0] == 0
    assert buf[8:16] == b"pool-abc" and buf[16] == 0
    assert len(disk.vol_args("x" * disk.VOL_NAME_MAX)) == 4096  # still NUL-terminated
    for bad in ("", "a/b", ".", "..", "x" * (disk.VOL_NAME_MAX + 1)):
        with pytest.raises(ValueError):
            disk.vol_args(bad)


def test_qgroup_limit_args_layout() -> None:
    buf = disk.qgroup_limit_args(256 << 20)
    assert len(buf) == 48  # sizeof(struct btrfs_ioctl_qgroup_limit_args)
    qgroupid, flags, max_rfer, max_excl, rsv_rfer, rsv_excl = struct.unpack("=6Q", buf)
    assert (qgroupid, flags, max_rfer) == (0, disk.QGROUP_LIMIT_MAX_RFER, 256 << 20)  # 0 = the fd's subvolume
    assert (max_excl, rsv_rfer, rsv_excl) == (0, 0, 0)
    assert struct.unpack("=6Q", disk.qgroup_limit_args(None))[2] == disk.UNLIMITED
    for bad in (0, -1, 1 << 64):
        with pytest.raises(ValueError):
            disk.qgroup_limit_args(bad)


def test_ino_lookup_and_fs_info_parsing() -> None:
    buf = disk.ino_lookup_args()
    assert len(buf) == 4096
    assert struct.unpack_from("=QQ", buf) == (0, disk.SUBVOL_ROOT_INO)  # treeid 0 = "the fd's tree"
    struct.pack_into("=Q", buf, 0, 263)  # what the kernel writes back
    assert disk.parse_ino_lookup(buf) == 263
    fsid = uuid.uuid4()
    info = bytearray(1024)
    info[16:32] = fsid.bytes  # after max_id and num_devices
    assert disk.parse_fs_info(info) == str(fsid)


def test_parse_mountinfo() -> None:
    text = (
        "22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
        "44 22 0:46 / /var/lib/aenv/sandboxes rw,noatime shared:30 - btrfs /dev/loop3 rw,discard=async,subvolid=5\n"
        "45 22 0:47 / /tmp/a\\040b rw - tmpfs tmp\\040fs rw\n"
        "garbage\n"
    )
    entries = disk.parse_mountinfo(text)
    assert [e.mount_point for e in entries] == ["/", "/var/lib/aenv/sandboxes", "/tmp/a b"]
    assert entries[1] == disk.MountEntry("/var/lib/aenv/sandboxes", "btrfs", "/dev/loop3")
    assert entries[2].source == "tmp fs"


def test_auto_size() -> None:
    assert disk.auto_size(500 << 30) == 64 << 30  # capped
    assert disk.auto_size(10 << 30) == 5 << 30  # half the free space
    assert disk.auto_size((3 << 20) + 5) == 1 << 20  # whole MiB


def test_remove_tree_plain_dirs(tmp_path: Path) -> None:
    d = tmp_path / "w"
    (d / "ns" / "upper").mkdir(parents=True)
    (d / "ns" / "upper" / "f").write_text("x")
    (d / "link").symlink_to("/etc")
    disk.remove_tree(d)
    assert not d.exists()
    disk.remove_tree(d)  # missing: fine
    f = tmp_path / "file"
    f.write_text("x")
    disk.remove_tree(f)  # not a directory: left alone, no error
    assert f.exists()


def test_subvolume_helpers_on_a_plain_dir(tmp_path: Path) -> None:
    assert disk.subvolume_id(tmp_path) is None
    assert disk.subvolume_id(tmp_path / "missing") is None
    assert disk.destroy_subvolume(tmp_path / "missing") is False


def test_disabled_quota_is_a_no_op(tmp_path: Path) -> None:
    q = disk.DiskQuota(tmp_path, tmp_path / "sandboxes", enabled=False)
    q.setup()
    assert not q.active
    assert q.describe() == "unavailable (disabled (ns_disk_quota = false))"
    root = tmp_path / "sandboxes" / "x" / "ns"
    q.make_root(root, 256)  # does nothing: the sandbox makes a plain directory itself
    assert not root.exists()
    assert q.usage(root) is None
    q.release()
    assert disk.probe(tmp_path, tmp_path / "sandboxes", enabled=False).startswith("unavailable (disabled")


def test_a_non_empty_sandboxes_dir_is_never_hidden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk, "_prerequisites", lambda: None)
    monkeypatch.setattr(disk, "_loop_prerequisites", lambda need_mkfs: None)
    monkeypatch.setattr(disk, "fs_uuid", lambda p: None)
    mounted: list[list[str]] = []
    monkeypatch.setattr(disk, "_run", lambda argv, timeout=0: mounted.append(argv))
    (tmp_path / "sandboxes" / "old-sandbox").mkdir(parents=True)
    q = disk.DiskQuota(tmp_path, tmp_path / "sandboxes")
    q.setup()
    assert not q.active and mounted == []
    assert "already holds 1 entries" in q.describe()

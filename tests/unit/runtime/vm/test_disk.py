"""ext4 images from directories and qcow2 overlays (needs e2fsprogs and qemu-utils)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from aenv.runtime.vm import disk

needs_tools = pytest.mark.skipif(
    shutil.which("mkfs.ext4") is None or shutil.which("qemu-img") is None,
    reason="needs e2fsprogs and qemu-utils",
)


@needs_tools
async def test_ext4_qcow2_overlay_chain(tmp_path: Path) -> None:
    src = tmp_path / "root"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "marker").write_text("hello")
    raw = await disk.make_ext4(src, tmp_path / "base.raw", size_mb=16)
    assert raw.stat().st_size == 16 * 2**20
    if shutil.which("debugfs"):
        out = subprocess.run(  # noqa: ASYNC221 - a test, nothing else on the loop
            ["debugfs", "-R", "cat /etc/marker", str(raw)], check=False, capture_output=True, text=True
        )
        assert out.stdout == "hello"
    base = await disk.to_qcow2(raw, tmp_path / "base.qcow2")
    ov = await disk.create_overlay(base, tmp_path / "empty.qcow2")
    info = await disk.image_info(ov)
    assert "backing file: " + str(base) in info
    clone = disk.clone_overlay(ov, tmp_path / "sb1.qcow2")
    assert clone.read_bytes() == ov.read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@needs_tools
async def test_overlay_with_backing_names_the_new_backing(tmp_path: Path) -> None:
    """The snapshot checkpoint's overlay: a copy of an empty overlay whose header names another
    backing image (longer and shorter names), nothing else changed; qemu-img reads the chain."""
    template_disk = tmp_path / "template.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(template_disk), "64M"], check=True)  # noqa: ASYNC221
    empty = await disk.create_overlay(template_disk, tmp_path / "empty.qcow2")
    top = tmp_path / "run" / ("deep-" * 20) / "root.qcow2"
    top.parent.mkdir(parents=True)
    disk.clone_overlay(empty, top)
    for backing in (top, tmp_path / "r.qcow2"):
        out = disk.overlay_with_backing(empty, backing, tmp_path / "next.qcow2")
        info = subprocess.run(  # noqa: ASYNC221 - a test
            ["qemu-img", "info", "-U", "--output=json", str(out)], check=True, capture_output=True, text=True
        ).stdout
        assert f'"backing-filename": "{backing}"' in info and '"virtual-size": 67108864' in info
        assert len(out.read_bytes()) == len(empty.read_bytes())
    chain = subprocess.run(  # noqa: ASYNC221
        ["qemu-img", "info", "-U", "--backing-chain", str(disk.overlay_with_backing(empty, top, tmp_path / "n2.qcow2"))],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    assert chain.count("image: ") == 3  # n2 -> root -> template
    (tmp_path / "raw.img").write_bytes(bytes(4096))
    with pytest.raises(disk.DiskError, match="not a qcow2"):
        disk.overlay_with_backing(tmp_path / "raw.img", top, tmp_path / "bad.qcow2")
    with pytest.raises(disk.DiskError, match="cannot name"):
        disk.overlay_with_backing(empty, Path("/" + "x" * 2000), tmp_path / "bad.qcow2")
    assert not (tmp_path / "bad.qcow2").exists()


@needs_tools
async def test_retarget_overlay_in_place(tmp_path: Path) -> None:
    """The pre-spawned restore process's overlay: same file (inode kept, QEMU has it open), new
    backing name; a later qemu-img reads the chain through the new backing."""
    for name in ("template.qcow2", "snapshot-disk.qcow2"):
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(tmp_path / name), "64M"], check=True)  # noqa: ASYNC221
    overlay = await disk.create_overlay(tmp_path / "template.qcow2", tmp_path / "root.qcow2")
    inode, size = overlay.stat().st_ino, overlay.stat().st_size
    disk.retarget_overlay(overlay, tmp_path / "snapshot-disk.qcow2")
    assert overlay.stat().st_ino == inode and overlay.stat().st_size == size
    info = await disk.image_info(overlay)
    assert f"backing file: {tmp_path / 'snapshot-disk.qcow2'}" in info and "template" not in info


@needs_tools
@pytest.mark.skipif(shutil.which("qemu-io") is None, reason="needs qemu-io (qemu-utils)")
async def test_flatten_keeps_every_layer_of_the_chain(tmp_path: Path) -> None:
    """template <- snapshot disk <- sandbox overlay: the flattened image over the template holds
    the middle layer's data and the top's (a rollback's or restored sandbox's next snapshot),
    and the template stays its backing file. (``qemu-img convert -B`` lost the middle layer.)"""

    def qemu_io(cmd: str, image: Path) -> str:
        return subprocess.run(  # noqa: ASYNC221 - a test
            ["qemu-io", "-c", cmd, str(image)], check=True, capture_output=True, text=True
        ).stdout

    base = tmp_path / "template.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(base), "16M"], check=True)  # noqa: ASYNC221
    qemu_io("write -P 0x11 2M 64k", base)
    mid = await disk.create_overlay(base, tmp_path / "snapshot-disk.qcow2")
    qemu_io("write -P 0xab 0 64k", mid)
    qemu_io("write -P 0x11 4M 64k", mid)
    top = await disk.create_overlay(mid, tmp_path / "root.qcow2")
    qemu_io("write -P 0xcd 1M 64k", top)
    out = await disk.flatten_onto(top, base, tmp_path / "flat.qcow2")
    for pattern, offset in (("0xab", "0"), ("0xcd", "1M"), ("0x11", "2M"), ("0x11", "4M"), ("0", "8M")):
        assert "verification failed" not in qemu_io(f"read -P {pattern} {offset} 64k", out), (pattern, offset)
    info = await disk.image_info(out)
    assert f"backing file: {base}" in info
    mapped = json.loads(subprocess.run(["qemu-img", "map", "--output=json", str(out)], check=True,  # noqa: ASYNC221
                                       capture_output=True, text=True).stdout)  # fmt: skip
    depth = {e["start"]: e["depth"] for e in mapped if e["data"]}
    assert depth[0] == 0 and depth[1 << 20] == 0  # middle and top layer data: in the flat image
    assert depth[2 << 20] == 1  # the template's own data stays in the template
    assert top.read_bytes() != out.read_bytes()  # a rebased copy; the top itself is untouched


@needs_tools
async def test_failure_has_stderr_and_no_leftovers(tmp_path: Path) -> None:
    with pytest.raises(disk.DiskError) as ei:
        await disk.to_qcow2(tmp_path / "missing.raw", tmp_path / "out.qcow2")
    assert "missing.raw" in str(ei.value)
    assert list(tmp_path.iterdir()) == []


def test_auto_size(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x" * (4 * 2**20))
    assert disk.auto_size_mb(tmp_path) >= 4 + 32

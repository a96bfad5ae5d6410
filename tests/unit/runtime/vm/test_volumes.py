"""vm volume exports: real bind mounts (root), taken apart without ever deleting a volume's files."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.runtime.base import SandboxImage, SandboxSpec, VolumeBind
from aenv.runtime.vm.volumes import VolumeExports, check_guest_state, hello_facts, release

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root")


def _spec(sid: str, *binds: VolumeBind) -> SandboxSpec:
    return SandboxSpec(sid, SandboxImage("t", Path("/rootfs")), Path("/work") / sid, volumes=binds)


@pytest.fixture
def vols(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """Two volume directories; every export under ``tmp_path/exports`` is taken apart afterwards,
    whatever the test did (pytest's own clean-up must never walk into a bind)."""
    a, b = tmp_path / "vol-a", tmp_path / "vol-b"
    for v in (a, b):
        v.mkdir()
        (v / "kept.txt").write_text(v.name)
    yield a, b
    VolumeExports(tmp_path / "exports").sweep(set())


@needs_root
def test_prepare_binds_each_volume_and_release_keeps_its_files(tmp_path: Path, vols: tuple[Path, Path]) -> None:
    a, b = vols
    exports = VolumeExports(tmp_path / "exports")
    spec = _spec("sbx1", VolumeBind(a, "/data"), VolumeBind(b, "/ro", read_only=True))
    export = exports.prepare(spec)
    assert export == tmp_path / "exports" / "sbx1" == exports.share_for(spec)
    assert (export / "vol-0" / "kept.txt").read_text() == "vol-a"
    (export / "vol-0" / "new.txt").write_text("through the export")
    assert (a / "new.txt").read_text() == "through the export"
    with pytest.raises(OSError) as ro:
        (export / "vol-1" / "x").write_text("no")
    assert ro.value.errno == errno.EROFS
    os.mkfifo(export / "vol-0" / "fifo")  # nodev: a device node would not open; a fifo still may
    assert exports.prepare(spec) == export  # idempotent: already bound slots stay
    exports.release("sbx1")
    assert not export.exists()
    assert (a / "kept.txt").read_text() == "vol-a" and (a / "new.txt").exists() and (b / "kept.txt").exists()
    exports.release("sbx1")  # idempotent


@needs_root
def test_binds_are_nodev_and_nosuid(tmp_path: Path, vols: tuple[Path, Path]) -> None:
    exports = VolumeExports(tmp_path / "exports")
    export = exports.prepare(_spec("sbx2", VolumeBind(vols[0], "/data")))
    assert export is not None
    opts = next(line.split()[5] for line in Path("/proc/self/mountinfo").read_text().splitlines()
                if line.split()[4] == str(export / "vol-0"))
    assert "nodev" in opts.split(",") and "nosuid" in opts.split(",")
    os.mknod(export / "vol-0" / "null", 0o600 | 0o020000, os.makedev(1, 3))
    with pytest.raises(PermissionError):
        open(export / "vol-0" / "null", "rb").close()  # noqa: SIM115
    exports.release("sbx2")


@needs_root
def test_sweep_releases_what_nobody_owns(tmp_path: Path, vols: tuple[Path, Path]) -> None:
    exports = VolumeExports(tmp_path / "exports")
    for sid in ("keep", "gone"):
        exports.prepare(_spec(sid, VolumeBind(vols[0], "/data")))
    assert exports.sweep({"keep"}) == ["gone"]
    assert (tmp_path / "exports" / "keep" / "vol-0" / "kept.txt").exists()
    assert (vols[0] / "kept.txt").exists()
    exports.release("keep")


def test_no_volumes_no_export(tmp_path: Path) -> None:
    exports = VolumeExports(tmp_path / "exports")
    assert exports.prepare(_spec("plain")) is None and exports.share_for(None) is None
    assert not (tmp_path / "exports").exists()


def test_release_never_removes_a_directory_with_files(tmp_path: Path) -> None:
    export = tmp_path / "e"
    (export / "vol-0").mkdir(parents=True)
    (export / "vol-0" / "data").write_text("x")  # not a mount: rmdir refuses, the file stays
    with pytest.raises(OSError):
        release(export)
    assert (export / "vol-0" / "data").read_text() == "x"


def test_guest_state_check() -> None:
    binds = (VolumeBind(Path("/v"), "/data"), VolumeBind(Path("/w"), "/ro", read_only=True))
    assert hello_facts(binds, "12-34") == {"epoch": "12-34", "mounts": [
        {"slot": "vol-0", "path": "/data", "readOnly": False}, {"slot": "vol-1", "path": "/ro", "readOnly": True}]}
    ok = json.dumps({"epoch": "12-34", "mounted": ["/data", "/ro"], "error": None}).encode()
    assert check_guest_state(ok, "12-34", binds) is None
    assert "this VM" in (check_guest_state(ok, "99-1", binds) or "")
    half = json.dumps({"epoch": "12-34", "mounted": ["/data"], "error": None}).encode()
    assert check_guest_state(half, "12-34", binds) == "not mounted in the guest: /ro"
    bad = json.dumps({"epoch": "12-34", "mounted": [], "error": "[Errno 19] No such device"}).encode()
    assert "No such device" in (check_guest_state(bad, "12-34", binds) or "")
    assert check_guest_state(b"not json", "12-34", binds) is not None

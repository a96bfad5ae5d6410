"""E2B volumes in CRIU's command lines: each volume bind is external (keyed by its mount point), a
restore binds the volume's source where it was, and a read-only one is checked and remounted
read-only at pre-resume (CRIU restores a bind with the dumped flags: a fork child's of a writer)."""

from __future__ import annotations

from pathlib import Path

from aenv.runtime.ns import criu


def _pairs(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--external" and "aenv-vol-" in argv[i + 1]]


def test_volume_keys_follow_the_mount_point() -> None:
    assert criu.volume_key("/data") == criu.volume_key("/data") != criu.volume_key("/data2")
    assert criu.volume_key("/data").startswith(criu.EXT_VOLUME)


def test_dump_and_restore_name_each_volume(tmp_path: Path) -> None:
    dump = criu.dump_argv("/c", 1, tmp_path, freezer=None, masked=(), volumes=["/data", "/mnt/x"])
    assert _pairs(dump) == [f"mnt[/data]:{criu.volume_key('/data')}", f"mnt[/mnt/x]:{criu.volume_key('/mnt/x')}"]
    assert _pairs(criu.dump_argv("/c", 1, tmp_path, freezer=None, masked=())) == []
    restore = criu.restore_argv("/c", tmp_path, root=tmp_path, pidfile=tmp_path / "p", tools=tmp_path, run_dir=tmp_path,
                                masked=(), volumes=[("/mnt/x", "/vols/b"), ("/data", "/vols/a")])
    assert sorted(_pairs(restore)) == sorted([f"mnt[{criu.volume_key('/data')}]:/vols/a",
                                              f"mnt[{criu.volume_key('/mnt/x')}]:/vols/b"])


def test_read_only_volumes_are_checked_at_pre_resume(tmp_path: Path) -> None:
    points = criu.read_only_points((), ["/data"])
    assert f"/data:{criu.VOLUME_FLAGS}" in points
    for compiled in (False, True):  # where no compiler is around, both are the shell form
        plain = criu.ro_remount_action((), base=tmp_path, compiled=compiled)
        with_volume = criu.ro_remount_action((), base=tmp_path, volumes=["/data"], compiled=compiled)
        text = Path(with_volume + ".conf") if Path(with_volume + ".conf").exists() else Path(with_volume)
        plain_text = Path(plain + ".conf") if Path(plain + ".conf").exists() else Path(plain)
        assert plain != with_volume and "/data" in text.read_text() and "/data" not in plain_text.read_text()
    sources = dict(criu.read_only_sources(tmp_path / "tools", None, (), ["/vols/a"]))
    assert sources["/vols/a"] == criu.VOLUME_FLAGS

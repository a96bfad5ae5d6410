"""The guest agent's volume mounts: what it mounts for an epoch, and that a new QEMU remounts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aenv.agent import launch, volumes


@pytest.fixture
def calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    log: list[tuple[str, ...]] = []
    monkeypatch.setattr(volumes, "STATE", tmp_path / "run" / "volumes.json")
    monkeypatch.setattr(volumes, "EXPORT_MOUNT", tmp_path / "run" / "volumes")
    monkeypatch.setattr(launch, "mount", lambda src, dst, fs, flags, data=None: log.append(
        ("mount", src, dst, str(fs), "ro" if flags & launch.MS_RDONLY else "rw")))
    monkeypatch.setattr(launch, "detach", lambda p: log.append(("detach", p)))
    return log


def _facts(tmp_path: Path, epoch: str, *mounts: tuple[str, str, bool]) -> dict[str, object]:
    return {"epoch": epoch, "mounts": [{"slot": s, "path": str(tmp_path / p), "readOnly": ro} for s, p, ro in mounts]}


def test_mounts_the_export_then_each_volume(tmp_path: Path, calls: list[tuple[str, ...]]) -> None:
    volumes.apply(_facts(tmp_path, "1-1", ("vol-0", "data", False), ("vol-1", "ref", True)))
    mounts = [c for c in calls if c[0] == "mount"]
    assert mounts[0][1:4] == ("aenv-volumes", str(volumes.EXPORT_MOUNT), "9p")
    assert mounts[1][1:] == (str(volumes.EXPORT_MOUNT / "vol-0"), str(tmp_path / "data"), "None", "rw")
    assert mounts[2][1] == str(volumes.EXPORT_MOUNT / "vol-1") and mounts[3][2:] == (str(tmp_path / "ref"), "None", "ro")
    assert (tmp_path / "data").is_dir()
    state = json.loads(volumes.STATE.read_text())
    assert state == {"epoch": "1-1", "mounted": [str(tmp_path / "data"), str(tmp_path / "ref")], "error": None}


def test_same_epoch_is_a_no_op_and_a_new_one_remounts(tmp_path: Path, calls: list[tuple[str, ...]]) -> None:
    facts = _facts(tmp_path, "1-1", ("vol-0", "data", False))
    volumes.apply(facts)
    n = len(calls)
    volumes.apply(facts)  # a plain resume: the same QEMU
    assert len(calls) == n
    volumes.apply(_facts(tmp_path, "2-9"))  # a restore into a QEMU without this sandbox's volumes
    assert calls[n:] == [("detach", str(tmp_path / "data")), ("detach", str(volumes.EXPORT_MOUNT))]
    assert json.loads(volumes.STATE.read_text())["mounted"] == []


def test_a_failure_is_reported_not_raised(tmp_path: Path, calls: list[tuple[str, ...]],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    def no_9p(*_: object) -> None:
        raise OSError(19, "No such device", "/run/aenv/volumes")

    monkeypatch.setattr(launch, "mount", no_9p)
    volumes.apply(_facts(tmp_path, "3-3", ("vol-0", "data", False)))
    state = json.loads(volumes.STATE.read_text())
    assert "No such device" in state["error"] and state["mounted"] == []
    monkeypatch.setattr(launch, "mount", lambda *a, **k: None)
    volumes.apply(_facts(tmp_path, "3-3", ("vol-0", "data", False)))  # a failed epoch is tried again
    assert json.loads(volumes.STATE.read_text())["error"] is None


@pytest.mark.parametrize("mount", [{"slot": "../x", "path": "/d"}, {"slot": "vol-0", "path": "rel"}, {"slot": 1}])
def test_bad_mounts_are_refused(tmp_path: Path, calls: list[tuple[str, ...]], mount: dict[str, object]) -> None:
    volumes.apply({"epoch": "4-4", "mounts": [mount]})
    assert not [c for c in calls if c[0] == "mount"]
    assert json.loads(volumes.STATE.read_text())["error"].startswith("bad mount")

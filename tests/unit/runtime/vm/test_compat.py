"""The machine record of saved VM state: how this host's is made, and which records restore here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from aenv.errors import MachineMismatch
from aenv.machine_key import compatible, describe, parse
from aenv.runtime.vm import compat
from aenv.runtime.vm.release import Releaser
from aenv.runtime.vm.table import Released, VmTable

CPUINFO = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse2 avx2\n\nprocessor\t: 1\nmodel name\t: AMD EPYC 7B13\n"


def test_the_qemu_release_is_major_minor() -> None:
    assert compat.parse_qemu_version("QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)\n") == "7.2"
    assert compat.parse_qemu_version("QEMU emulator version 10.0.0\n") == "10.0"
    assert compat.parse_qemu_version("no such thing") is None


def test_tcg_guests_see_max_and_kvm_guests_the_host_cpu() -> None:
    assert compat.cpu_model("tcg", CPUINFO) == "max"
    kvm = compat.cpu_model("kvm", CPUINFO)
    assert kvm.startswith("AMD EPYC 7B13 #")
    # the same flags in another order are the same CPU; another flag set is another
    assert compat.cpu_model("kvm", CPUINFO.replace("fpu sse2 avx2", "avx2 fpu sse2")) == kvm
    assert compat.cpu_model("kvm", CPUINFO.replace("avx2", "avx512f")) != kvm


def test_host_key_reads_cpuinfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "qemu_version", lambda: "7.2")
    (tmp_path / "cpuinfo").write_text(CPUINFO)
    assert compat.host_key("tcg", tmp_path / "cpuinfo") == {"accel": "tcg", "cpu": "max", "qemu": "7.2"}
    assert compat.host_key("kvm", tmp_path / "missing")["cpu"].startswith("unknown #")


def test_records_parse_strictly() -> None:
    good = {"accel": "tcg", "cpu": "max", "qemu": "7.2"}
    assert parse(good) == good
    for bad in (None, "tcg", {"accel": "tcg", "cpu": "max"}, {**good, "extra": "x"}, {**good, "qemu": ""},
                {**good, "qemu": 7.2}):  # fmt: skip
        assert parse(bad) is None
    assert describe(good) == "tcg, cpu max, QEMU 7.2" and describe(None) == "unknown machine"


def test_no_record_restores_anywhere_and_a_record_only_on_its_machine() -> None:
    here = {"accel": "tcg", "cpu": "max", "qemu": "7.2"}
    assert compatible(None, here) and compatible(None, None)
    assert compatible(dict(here), here)
    assert not compatible({**here, "qemu": "8.0"}, here)
    assert not compatible(here, None)  # a record needs a known machine


def test_check_refuses_another_machine_naming_both() -> None:
    here = {"accel": "tcg", "cpu": "max", "qemu": "7.2"}
    compat.check({}, here, "snapshot 's1'")  # taken before records: accepted
    compat.check({"machine": None}, here, "snapshot 's1'")
    compat.check({"machine": dict(here)}, here, "snapshot 's1'")
    other = {"accel": "kvm", "cpu": "AMD EPYC #12345678", "qemu": "7.2"}
    with pytest.raises(MachineMismatch) as info:
        compat.check({"machine": other}, here, "snapshot 's1'")
    assert info.value.recorded == other and info.value.here == here
    assert "snapshot 's1'" in info.value.message
    assert describe(other) in info.value.message and describe(here) in info.value.message


class _Templates:
    def __init__(self) -> None:
        self.asked: list[str] = []

    async def by_key(self, key: str) -> Any:
        self.asked.append(key)
        raise RuntimeError("reached the template: the check passed")


async def test_a_released_pause_of_another_machine_stays_released(tmp_path: Path) -> None:
    here = {"accel": "tcg", "cpu": "max", "qemu": "7.2"}
    table, templates = VmTable(), _Templates()
    releaser = Releaser(table, templates, tmp_path, 60.0, 0.0, machine=lambda: here)  # type: ignore[arg-type]
    rel = Released("b", tmp_path / "b", "t-key", 0, False)
    rel.run_dir.mkdir()
    table.released["b"] = rel
    rel.marker.write_text(json.dumps({"ram_id": "r", "mem_chain": [], "machine": {**here, "qemu": "8.0"}}))
    with pytest.raises(MachineMismatch) as info:
        await releaser.load_locked("b", run=True)
    assert "sandbox 'b'" in info.value.message and templates.asked == [] and "b" in table.released
    for marker in ({"ram_id": "r", "mem_chain": [], "machine": here}, {"ram_id": "r"}):  # its own, or none
        rel.marker.write_text(json.dumps(marker))
        with pytest.raises(RuntimeError, match="check passed"):
            await releaser.load_locked("b", run=True)


async def test_a_snapshot_of_another_template_build_is_refused(tmp_path: Path) -> None:
    """A vm snapshot's disk is layered on its template build's disk: another build (another node, or a
    rebuild here) is refused before anything starts; the same build, or a snapshot without a record, is not."""
    from types import SimpleNamespace

    from aenv.errors import Conflict
    from aenv.kinds import SnapshotMode
    from aenv.runtime.base import SnapshotResult
    from aenv.runtime.vm.snapshot import TEMPLATE_BUILD, VmSnapshots

    here = {"accel": "tcg", "cpu": "max", "qemu": "7.2"}
    local: dict[str, Any] = {"base-k": SimpleNamespace(ram_id="build-here")}

    class Templates:
        async def find(self, key: str) -> Any:
            return local.get(key)

    flows = VmSnapshots(None, Templates(), None, None, run_root=tmp_path, shm_dir=tmp_path, pids_limit=1,  # type: ignore[arg-type]
                        start=lambda: None, machine=lambda: here)  # type: ignore[arg-type,return-value]

    def result(**data: Any) -> SnapshotResult:
        return SnapshotResult(mode=SnapshotMode.FULL, layers=(), data={"template_key": "base-k", "machine": here, **data})

    await flows.check_restorable(tmp_path / "s1", result(**{TEMPLATE_BUILD: "build-here"}))
    await flows.check_restorable(tmp_path / "s1", result(format="layered", ram_id="build-here"))
    await flows.check_restorable(tmp_path / "s1", result())  # taken before builds were recorded
    for other in (result(**{TEMPLATE_BUILD: "build-elsewhere"}), result(format="layered", ram_id="build-elsewhere")):
        with pytest.raises(Conflict, match="another build of template base-k"):
            await flows.check_restorable(tmp_path / "s1", other)
    local.clear()  # the template was never built here
    with pytest.raises(Conflict, match="do not move between nodes"):
        await flows.check_restorable(tmp_path / "s1", result(**{TEMPLATE_BUILD: "build-here"}))

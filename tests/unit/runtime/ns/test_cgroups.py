"""cgroups: layout detection from mountinfo, and the file protocol against a fake hierarchy."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from aenv.runtime.ns import cgroups
from aenv.runtime.ns.cgroups import Cgroup, Layout

HYBRID = """\
30 24 0:26 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec shared:10 - cgroup2 cgroup2 rw
33 30 0:29 / /sys/fs/cgroup/cpu rw,nosuid,nodev,noexec shared:12 - cgroup cgroup rw,cpu
34 30 0:30 / /sys/fs/cgroup/cpuacct rw,nosuid,nodev,noexec shared:13 - cgroup cgroup rw,cpuacct
35 30 0:31 / /sys/fs/cgroup/memory rw,nosuid,nodev,noexec shared:14 - cgroup cgroup rw,memory
36 30 0:32 / /sys/fs/cgroup/pids rw,nosuid,nodev,noexec shared:15 - cgroup cgroup rw,pids
37 30 0:33 / /sys/fs/cgroup/freezer rw,nosuid,nodev,noexec shared:16 - cgroup cgroup rw,freezer
"""

COMOUNTED = """\
33 30 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct
35 30 0:31 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory
36 30 0:32 / /sys/fs/cgroup/pids rw,nosuid - cgroup cgroup rw,pids
37 30 0:33 / /sys/fs/cgroup/freezer rw,nosuid - cgroup cgroup rw,freezer
"""


def test_detect_hybrid_prefers_v1() -> None:
    layout = cgroups.detect(HYBRID)
    assert layout.version == 1
    assert layout.v1["memory"] == Path("/sys/fs/cgroup/memory")
    assert layout.v1["cpuacct"] == Path("/sys/fs/cgroup/cpuacct")


def test_detect_comounted_dedups_parents() -> None:
    layout = cgroups.detect(COMOUNTED)
    assert layout.v1["cpu"] == layout.v1["cpuacct"]
    assert len(layout.parents()) == 4


def test_detect_v2(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids\n")
    info = f"31 24 0:27 / {tmp_path} rw,nosuid - cgroup2 cgroup2 rw\n"
    layout = cgroups.detect(info)
    assert layout.version == 2 and layout.v2 == tmp_path
    assert layout.parents() == [tmp_path / "aenv"]


def test_detect_nothing_usable() -> None:
    with pytest.raises(cgroups.CgroupError):
        cgroups.detect("")


@pytest.fixture
def fake_v1(tmp_path: Path) -> Layout:
    mounts = {c: tmp_path / c for c in cgroups.V1_CONTROLLERS}
    for m in mounts.values():
        m.mkdir()
    return Layout(version=1, v1=mounts)


def _seed(cg: Cgroup) -> None:
    (cg.dir("memory") / "memory.usage_in_bytes").write_text("1000\n")
    (cg.dir("memory") / "memory.stat").write_text("cache 10\ntotal_cache 200\nrss 5\n")
    (cg.dir("memory") / "memory.limit_in_bytes").write_text("4096\n")
    (cg.dir("cpuacct") / "cpuacct.usage").write_text("123456\n")
    (cg.dir("freezer") / "freezer.state").write_text("THAWED\n")


def test_v1_limits_usage_rename_remove(fake_v1: Layout) -> None:
    cg = Cgroup(fake_v1, "pool-1")
    cg.create()
    assert cg.exists()
    cg.set_limits(cpu_count=3, memory_mb=256, pids=99)
    assert (cg.dir("cpu") / "cpu.cfs_quota_us").read_text() == "300000"
    assert (cg.dir("cpu") / "cpu.cfs_period_us").read_text() == "100000"
    assert (cg.dir("memory") / "memory.limit_in_bytes").read_text() == str(256 * 1024 * 1024)
    assert (cg.dir("pids") / "pids.max").read_text() == "99"
    assert cg.procs_files()[0].endswith("pool-1/cgroup.procs")
    cg.rename("sbx1")
    assert cg.name == "sbx1" and cg.dir("memory").name == "sbx1"
    assert cgroups.list_names(fake_v1) == {"sbx1"}
    _seed(cg)
    u = cg.usage()
    assert (u.cpu_ns, u.mem_used, u.mem_cache, u.mem_limit) == (123456, 1000, 200, 4096)
    cg.freeze(timeout=1)  # a plain file echoes what we write, like a freezer that froze at once
    assert cg.frozen()
    cg.thaw(timeout=1)
    for d in cg.dirs():
        for f in d.iterdir():
            f.unlink()
    cg.remove()
    cg.remove()  # idempotent
    assert not cg.exists()


def test_scope_separates_runtimes(fake_v1: Layout, tmp_path: Path) -> None:
    import dataclasses

    a = dataclasses.replace(fake_v1, scope=cgroups.scope_for(tmp_path / "state-a"))
    b = dataclasses.replace(fake_v1, scope=cgroups.scope_for(tmp_path / "state-b"))
    assert a.scope != b.scope and a.scope == cgroups.scope_for(tmp_path / "state-a")
    Cgroup(a, "sbx").create()
    assert Cgroup(a, "sbx").dir("memory") == fake_v1.v1["memory"] / "aenv" / a.scope / "sbx"
    assert cgroups.list_names(a) == {"sbx"}
    assert cgroups.list_names(b) == set()  # b's reconciliation never sees a's sandboxes


def test_v1_memory_limit_can_be_raised_past_memsw(tmp_path: Path) -> None:
    """A pooled sandbox got the default limits (memsw == limit); handing it out with more memory
    raised memory.limit_in_bytes above memsw, which a real v1 hierarchy refuses with EINVAL."""
    import os

    try:
        layout = cgroups.detect()
    except cgroups.CgroupError as exc:
        pytest.skip(f"no usable cgroups: {exc}")
    if os.geteuid() != 0 or layout.version != 1:
        pytest.skip("needs root and a cgroup v1 memory hierarchy")
    import dataclasses

    layout = dataclasses.replace(layout, scope=cgroups.scope_for(tmp_path / "state"))
    probe = layout.base("memory").parent
    while not probe.is_dir():  # aenv's own cgroup may not exist yet on a machine that ran no sandbox
        probe = probe.parent
    if not (probe / "memory.memsw.limit_in_bytes").exists():
        pytest.skip("no swap accounting (memory.memsw.*) on this kernel")
    cg = Cgroup(layout, "raise-test")
    cg.create()
    try:
        cg.set_limits(cpu_count=1, memory_mb=256, pids=99)
        cg.set_limits(cpu_count=1, memory_mb=1024, pids=99)
        for f in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"):
            assert int((cg.dir("memory") / f).read_text()) == 1024 * 1024 * 1024
        cg.set_limits(cpu_count=1, memory_mb=128, pids=99)
        for f in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"):
            assert int((cg.dir("memory") / f).read_text()) == 128 * 1024 * 1024
    finally:
        cg.remove()
        for d in layout.parents():
            with contextlib.suppress(OSError):
                d.rmdir()


@pytest.mark.parametrize("version", [1, 2])
def test_weights_low_ordinary_and_a_hand_outs_high(tmp_path: Path, fake_v1: Layout, version: int) -> None:
    layout = fake_v1 if version == 1 else Layout(version=2, v2=tmp_path / "unified")
    cg = Cgroup(layout, "sbx1")
    cg.dir("cpu").mkdir(parents=True, exist_ok=True)
    weight = cg.dir("cpu") / ("cpu.shares" if version == 1 else "cpu.weight")
    seen = []
    for low, high in ((True, False), (False, False), (False, True), (True, True)):
        cg.set_weight(low=low, high=high)
        seen.append(weight.read_text())
    # low wins over high: a pooled sandbox is never raised above the ones in use
    assert seen == (["2", "1024", "10240", "2"] if version == 1 else ["1", "100", "1000", "1"])

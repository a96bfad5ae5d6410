"""Reconciliation over a fake cgroup tree and state dir: what is unknown goes, what is known stays."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from aenv.runtime.ns import cgroups
from aenv.runtime.ns.cgroups import Cgroup, Layout
from aenv.runtime.ns.reconcile import reconcile
from aenv.runtime.process import ProcRef


def fake_layout(tmp: Path) -> Layout:
    mounts = {c: tmp / "cg" / c for c in cgroups.V1_CONTROLLERS}
    for m in mounts.values():
        m.mkdir(parents=True)
    return Layout(version=1, v1=mounts, scope="stest")


def make_sandbox(layout: Layout, top: Path, name: str, ns_dir: Path, pid: int, start: int) -> None:
    Cgroup(layout, name).create()
    ns_dir.mkdir(parents=True)
    (ns_dir / "ns.json").write_text(json.dumps({
        "kind": "ns", "name": name, "dir": str(ns_dir), "pid": pid, "start": start,
        "cgroup": name, "slirp": None, "allow_internet": False, "template_id": "t"}))


async def test_reconcile_kills_unknown_keeps_known(tmp_path: Path) -> None:
    layout = fake_layout(tmp_path)
    sandboxes, pool = tmp_path / "state" / "sandboxes", tmp_path / "state" / "ns-pool"
    victim = subprocess.Popen(["sleep", "60"])  # noqa: ASYNC220 - a bystander, started synchronously on purpose
    ref = ProcRef.of(victim.pid)
    assert ref is not None
    make_sandbox(layout, sandboxes / "known", "known", sandboxes / "known" / "ns", 1, 0)
    make_sandbox(layout, sandboxes / "lost", "lost", sandboxes / "lost" / "ns", ref.pid, ref.start)
    make_sandbox(layout, pool / "pool-1", "pool-1", pool / "pool-1", 1, 0)
    Cgroup(layout, "stray").create()  # a cgroup whose state file never got written
    (sandboxes / "vm-sbx").mkdir()  # another runtime's sandbox: no ns/ inside, must stay

    report = await reconcile(layout, sandboxes, pool, {"known"})

    assert sorted(report.killed) == ["lost", "pool-1"]
    assert victim.wait(timeout=5) == -9  # the init recorded with the right start time was SIGKILLed
    assert "stray" in report.cgroups_removed
    assert cgroups.list_names(layout) == {"known"}
    assert (sandboxes / "known" / "ns" / "ns.json").exists()
    assert not (sandboxes / "lost").exists() and not (pool / "pool-1").exists()
    assert (sandboxes / "vm-sbx").exists()


async def test_reconcile_never_kills_a_recycled_pid(tmp_path: Path) -> None:
    layout = fake_layout(tmp_path)
    sandboxes, pool = tmp_path / "s", tmp_path / "p"
    bystander = subprocess.Popen(["sleep", "60"])  # noqa: ASYNC220
    ref = ProcRef.of(bystander.pid)
    assert ref is not None
    make_sandbox(layout, sandboxes / "old", "old", sandboxes / "old" / "ns", ref.pid, ref.start + 1)
    await reconcile(layout, sandboxes, pool, set())
    assert bystander.poll() is None  # same pid, different start time: not ours
    bystander.kill()
    bystander.wait()

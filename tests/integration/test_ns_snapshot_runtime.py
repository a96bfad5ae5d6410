"""NsRuntime's SnapshotCapable half driven directly (no server): snapshot → create, fork with a failing
child, rollback that keeps ID and state dir, a failed rollback that restarts the sandbox on its own
files, and no leftovers. Busybox rootfs as in ``test_ns_runtime``. No wall-clock assertions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from aenv.config import Settings
from aenv.errors import RuntimeFailure, StateError
from aenv.runtime.base import RuntimeState, SandboxImage, SandboxSpec
from aenv.runtime.ns import NsRuntime, criu
from tests.fixtures.runtime import fork_via
from tests.integration.test_ns_runtime import busybox_root, run_cmd, settings, spec_for, template, traces

__all__ = ["busybox_root", "settings", "template"]

pytestmark = [pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rt(settings: Settings, busybox_root: Path) -> AsyncIterator[NsRuntime]:
    runtime = NsRuntime(settings, pool_size=0)
    await runtime.start()
    yield runtime
    for sid in list(runtime.table.running):
        await runtime.kill(sid)
    await runtime.close()


async def sh(rt: NsRuntime, sid: str, cmd: str) -> str:
    code, out, err = await run_cmd(rt, sid, cmd)
    assert code == 0, err
    return out


async def test_snapshot_create_and_capabilities(rt: NsRuntime, settings: Settings, template: SandboxImage,
                                                tmp_path: Path) -> None:
    caps = rt.capabilities()
    assert caps["snapshot"] == ("filesystem" if not criu.probe().usable else caps["snapshot"])
    assert caps["criu"] == criu.probe().describe()
    spec = spec_for(settings, template)
    await rt.create(spec)
    await sh(rt, spec.sandbox_id, "echo a > /root/a; rm /etc/group; mkdir -p /srv/x && echo y > /srv/x/y")
    snap = tmp_path / "snap"
    snap.mkdir()
    if not criu.probe().usable:
        with pytest.raises(StateError, match="filesystem"):
            await rt.snapshot(spec.sandbox_id, snap, "full")
        assert not (snap / "upper").exists()
    result = await rt.snapshot(spec.sandbox_id, snap, "filesystem")
    assert result.mode == "filesystem" and result.layers == ("upper",)
    assert result.stack == () and result.base_lowers == (str(template.rootfs),)
    assert result.paused_ms is not None and result.paused_ms > 0  # frozen while the upper was copied
    assert not rt.sandbox(spec.sandbox_id).cgroup.frozen()

    child = spec_for(settings, template)
    state = await rt.create_from_snapshot(child, snap, result)
    assert state.data["lowers"] == [str(snap / "upper"), str(template.rootfs)]
    assert await sh(rt, child.sandbox_id, "cat /root/a /srv/x/y; test -e /etc/group || echo gone") == "a\ny\ngone\n"
    # the child's own snapshot is a delta on top of the first
    await sh(rt, child.sandbox_id, "echo b > /root/b")
    snap2 = tmp_path / "snap2"
    snap2.mkdir()
    r2 = await rt.snapshot(child.sandbox_id, snap2, "filesystem")
    assert r2.stack == (str(snap / "upper"),) and r2.base_lowers == (str(template.rootfs),) and r2.depth == 1
    assert sorted(p.name for p in (snap2 / "upper" / "root").iterdir()) == ["b"]
    for sid in (spec.sandbox_id, child.sandbox_id):
        await rt.kill(sid)


async def test_fork_one_child_failing(rt: NsRuntime, settings: Settings, template: SandboxImage, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    src = spec_for(settings, template)
    await rt.create(src)
    await sh(rt, src.sandbox_id, "echo prepared > /root/p")
    children = [spec_for(settings, template) for _ in range(3)]
    real = rt.snapshots._launch_ready  # the part's call back into the runtime

    async def flaky(spec: SandboxSpec, *a: Any, **kw: Any) -> RuntimeState:
        if spec.sandbox_id == children[1].sandbox_id:
            raise RuntimeFailure("injected start failure")
        return await real(spec, *a, **kw)

    real_full = rt.snapshots.restore_processes

    async def flaky_full(spec: SandboxSpec, *a: Any, **kw: Any) -> RuntimeState:  # a fork with processes (CRIU)
        if spec.sandbox_id == children[1].sandbox_id:
            raise RuntimeFailure("injected restore failure")
        return await real_full(spec, *a, **kw)

    monkeypatch.setattr(rt.snapshots, "_launch_ready", flaky)
    monkeypatch.setattr(rt.snapshots, "restore_processes", flaky_full)
    scratch = tmp_path / "fork"
    result, states = await fork_via(rt, src.sandbox_id, children, scratch)
    monkeypatch.undo()
    assert result.mode == ("full" if criu.probe().usable else "filesystem")
    assert isinstance(states[1], RuntimeFailure)
    assert not (children[1].workdir).exists()
    for spec, st in ((children[0], states[0]), (children[2], states[2])):
        assert isinstance(st, RuntimeState)
        assert await sh(rt, spec.sandbox_id, "cat /root/p") == "prepared\n"
    await sh(rt, children[0].sandbox_id, "echo mine > /root/p")
    assert await sh(rt, children[2].sandbox_id, "cat /root/p") == "prepared\n"
    assert await sh(rt, src.sandbox_id, "cat /root/p") == "prepared\n"
    states_by_id = {c.sandbox_id: s for c, s in zip(children, states, strict=True) if isinstance(s, RuntimeState)}
    for sid, st in states_by_id.items():
        await rt.kill(sid, st)
        assert traces(rt, sid, st) == []
    await rt.kill(src.sandbox_id)


async def test_rollback_in_place_and_failed_rollback(rt: NsRuntime, settings: Settings, template: SandboxImage,
                                                     tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = spec_for(settings, template)
    first = await rt.create(spec)
    sid = spec.sandbox_id
    await sh(rt, sid, "echo 1 > /root/v")
    snap = tmp_path / "rb"
    snap.mkdir()
    result = await rt.snapshot(sid, snap, "filesystem")
    await sh(rt, sid, "echo 2 > /root/v; echo x > /root/extra; sleep 600 >/dev/null 2>&1 &")
    state = await rt.rollback(sid, spec, snap, result)
    assert state.data["name"] == sid and state.data["dir"] == first.data["dir"] and state.data["pid"] != first.data["pid"]
    assert await sh(rt, sid, "cat /root/v; ls /root") == "1\nv\n"
    assert "sleep 600" not in await sh(rt, sid, "ps -o args")

    # a rollback whose start fails puts the sandbox back on its own files
    await sh(rt, sid, "echo 3 > /root/v")
    real = rt.snapshots._launch_ready
    calls = 0

    async def fail_once(*a: Any, **kw: Any) -> RuntimeState:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeFailure("injected")
        return await real(*a, **kw)

    monkeypatch.setattr(rt.snapshots, "_launch_ready", fail_once)
    with pytest.raises(RuntimeFailure, match="injected"):
        await rt.rollback(sid, spec, snap, result)
    monkeypatch.undo()
    assert calls == 2
    assert await sh(rt, sid, "cat /root/v") == "3\n"

    # the same when the new sandbox cannot even start (the old upper never moved)
    async def no_start(*a: Any, **kw: Any) -> Any:
        raise RuntimeFailure("injected prelaunch")

    monkeypatch.setattr(rt.snapshots, "_prelaunch", no_start)
    with pytest.raises(RuntimeFailure, match="injected prelaunch"):
        await rt.rollback(sid, spec, snap, result)
    monkeypatch.undo()
    assert await sh(rt, sid, "cat /root/v") == "3\n"
    assert sorted(p.name for p in spec.workdir.iterdir() if p.name.startswith(".rollback-new")) == []
    last = RuntimeState(rt.table.state(rt.sandbox(sid), spec.workdir).data)
    await rt.kill(sid)
    assert traces(rt, sid, last) == []

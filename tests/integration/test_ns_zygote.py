"""The zygote start path and its fallback: both give a working sandbox; with the zygote, the sandbox's
PID 1 is the zygote's child and envd runs without an exec of its own (it shares the agent's cmdline)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.runtime.base import SandboxImage
from aenv.runtime.ns.runtime import NsRuntime
from tests.integration.test_ns_runtime import busybox_root, run_cmd, spec_for  # noqa: F401

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the ns runtime needs root")


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.fixture(params=[True, False], ids=["zygote", "exec"])
async def runtime(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[NsRuntime, Settings, bool]]:
    zygote = bool(request.param)
    monkeypatch.setenv("AENV_NS_ZYGOTE", "1" if zygote else "0")
    # the zygote's in-process launch has no user namespace: it is the start path of ns_userns_uid = 0
    settings = Settings(state_dir=tmp_path / "state", cache_dir=Path(os.environ.get("AENV_CACHE_DIR", "/var/cache/aenv")),
                        **({"ns_userns_uid": 0} if zygote else {}))
    rt = NsRuntime(settings, pool_size=0)
    await rt.start()
    try:
        yield rt, settings, zygote
    finally:
        await rt.close()


async def test_start_paths(runtime: tuple[NsRuntime, Settings, bool], busybox_root: Path) -> None:  # noqa: F811
    rt, settings, zygote = runtime
    spec = spec_for(settings, SandboxImage("busybox", busybox_root))
    state = await rt.create(spec)
    init_pid = int(state.data["pid"])
    code, out, _ = await run_cmd(rt, spec.sandbox_id, "echo hi; cat /proc/1/cmdline | tr '\\0' ' '")
    assert code == 0 and out.startswith("hi")
    if zygote:
        assert rt.host.zygote is not None and rt.host.zygote.running
        assert _ppid(init_pid) == rt.host.zygote._proc.pid  # type: ignore[union-attr]
        assert "aenv.agent.zygote" in out  # PID 1 is a fork of the zygote, never exec'd
    else:
        assert rt.host.zygote is None
        assert "aenv.agent" in out and "zygote" not in out
    await rt.kill(spec.sandbox_id)
    assert not Path(f"/proc/{init_pid}").exists() or Path(f"/proc/{init_pid}/stat").read_text().split()[2] == "Z"


async def test_sandbox_processes_have_no_admin_capability(
    runtime: tuple[NsRuntime, Settings, bool], busybox_root: Path  # noqa: F811
) -> None:
    """PID 1 (agent) and envd must not hold CAP_SYS_ADMIN (bit 21), on either start path."""
    rt, settings, _ = runtime
    spec = spec_for(settings, SandboxImage("busybox", busybox_root))
    await rt.create(spec)
    code, out, _ = await run_cmd(rt, spec.sandbox_id, "for p in /proc/[0-9]*; do grep CapEff $p/status; done")
    assert code == 0
    masks = [int(line.split()[1], 16) for line in out.splitlines() if line.startswith("CapEff")]
    assert len(masks) >= 2  # at least the agent and envd
    assert all(not (m >> 21) & 1 for m in masks), out
    await rt.kill(spec.sandbox_id)

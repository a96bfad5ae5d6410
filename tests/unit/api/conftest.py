"""Control-plane tests against a fake runtime: lifecycle and HTTP shapes without real sandboxes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from aenv.api.app import create_app
from aenv.config import Settings
from aenv.errors import SandboxNotFound
from aenv.runtime.base import UNFINISHED_MARKER, ResourceSample, RuntimeState, SandboxSpec, SnapshotResult


class FakeRuntime:
    """Records calls; sandboxes are dict entries. Lets API tests run anywhere, in milliseconds."""

    name = "fake"

    def __init__(self) -> None:
        self.sandboxes: dict[str, str] = {}
        self.calls: list[tuple[str, str]] = []
        self.fail_create = False
        # True: snapshot() returns before its files are written, like the vm runtime; the test ends
        # the write with finish_files().
        self.defer_files = False
        self._deferred: list[tuple[Any, Any, Path]] = []

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def create(self, spec: SandboxSpec) -> RuntimeState:
        self.calls.append(("create", spec.sandbox_id))
        if self.fail_create:
            from aenv.errors import RuntimeFailure

            raise RuntimeFailure("boom")
        self.sandboxes[spec.sandbox_id] = "running"
        return RuntimeState({"fake": True})

    async def open_stream(self, sandbox_id: str, port: int) -> Any:
        raise SandboxNotFound(sandbox_id)

    async def pause(self, sandbox_id: str) -> RuntimeState:
        self.calls.append(("pause", sandbox_id))
        self.sandboxes[sandbox_id] = "paused"
        return RuntimeState({})

    async def resume(self, sandbox_id: str, state: RuntimeState) -> RuntimeState:
        self.calls.append(("resume", sandbox_id))
        self.sandboxes[sandbox_id] = "running"
        return RuntimeState({})

    async def kill(self, sandbox_id: str, state: RuntimeState | None = None) -> None:
        self.calls.append(("kill", sandbox_id))
        self.sandboxes.pop(sandbox_id, None)

    async def adopt(self, sandbox_id: str, spec: SandboxSpec, state: RuntimeState) -> bool:
        return sandbox_id in self.sandboxes

    async def metrics(self, sandbox_id: str) -> ResourceSample:
        return ResourceSample(time.time(), 2, 12.5, 100 << 20, 512 << 20, 10 << 20, 5 << 20, 2 << 30)

    def capabilities(self) -> dict[str, Any]:
        return {"pause": "fake"}

    # SnapshotCapable: a snapshot is a marker file; `modes` says what this fake can capture.
    modes = ("full", "filesystem")

    async def snapshot(self, sandbox_id: str, into: Path, mode: str) -> SnapshotResult:
        self.calls.append(("snapshot", sandbox_id))
        got = mode if mode in self.modes else "filesystem"
        (into / "state").write_text(f"{sandbox_id}:{got}")
        data = {"paused_ms": 1.5} if got == "full" else {}  # the vm runtime reports how long it stopped
        if not self.defer_files:
            return SnapshotResult(mode=got, layers=("state",), data=data)
        (into / UNFINISHED_MARKER).touch()
        loop = asyncio.get_running_loop()
        pending = loop.create_future()
        self._deferred.append((loop, pending, into))
        return SnapshotResult(mode=got, layers=("state", "late"), data=data, pending=pending)

    def finish_files(self, ok: bool = True) -> None:
        """From the test's thread: end the oldest deferred snapshot write (10 kB more, or a failure)."""
        loop, pending, into = self._deferred.pop(0)

        def done() -> None:
            if ok:
                (into / "late").write_bytes(b"x" * 10_000)
                (into / UNFINISHED_MARKER).unlink()
                pending.set_result(None)
            else:
                pending.set_exception(OSError("disk full"))

        loop.call_soon_threadsafe(done)

    async def create_from_snapshot(self, spec: SandboxSpec, snapshot: Path, result: SnapshotResult) -> RuntimeState:
        self.calls.append(("restore", spec.sandbox_id))
        assert (snapshot / "state").exists()
        self.sandboxes[spec.sandbox_id] = "running"
        return RuntimeState({"from": str(snapshot)})

    async def fork(self, sandbox_id: str, children: list[SandboxSpec], scratch: Path) -> tuple[SnapshotResult, list[Any]]:
        result = await self.snapshot(sandbox_id, scratch, "full")
        states: list[Any] = [await self.create_from_snapshot(spec, scratch, result) for spec in children]
        return result, states

    async def rollback(self, sandbox_id: str, spec: SandboxSpec, snapshot: Path, result: SnapshotResult) -> RuntimeState:
        self.calls.append(("rollback", sandbox_id))
        self.sandboxes[sandbox_id] = "running"
        return RuntimeState({"rolled_to": str(snapshot)})


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    s = Settings(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache", reaper_interval=0.05, max_timeout=3600)
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    return s


@pytest.fixture
def runtime() -> FakeRuntime:
    return FakeRuntime()


@pytest.fixture
def client(settings: Settings, runtime: FakeRuntime, tmp_path: Path) -> Iterator[TestClient]:
    app = create_app(settings, runtime=runtime, ensure_base=False)  # type: ignore[arg-type]
    with TestClient(app) as c:
        c.app_state = app.app.state  # type: ignore[attr-defined]
        app.app.state.catalog.register(alias="base", kind="bootstrap", rootfs=tmp_path / "rootfs", template_id="base")
        yield c

"""vm snapshots restore only on their machine: the record in a snapshot's JSON, the node's own in
``/aenv/info``, and the 409 ``reason: machine`` before anything is stored or started (fake runtime
that records and checks machines the way the vm runtime does)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from aenv.runtime.base import SnapshotResult
from aenv.runtime.vm import compat
from tests.fixtures.runtime import FakeRuntime

TCG = {"accel": "tcg", "cpu": "max", "qemu": "7.2"}
KVM = {"accel": "kvm", "cpu": "AMD EPYC 7B13 #0011aabb", "qemu": "7.2"}


class MachineRuntime(FakeRuntime):
    """A fake with a machine: its snapshots record it (unless ``record`` is off); core asks it to check
    a snapshot before a restore (its restores themselves do not check: core's check is what is tested)."""

    def __init__(self) -> None:
        super().__init__()
        self.here: dict[str, str] | None = dict(TCG)
        self.record = True

    def machine(self) -> dict[str, str] | None:
        return self.here

    def check_restore(self, what: str, result: SnapshotResult) -> None:
        compat.check(result.data, self.here, what)

    def warm_counts(self) -> dict[str, int]:
        return {"base": 2}

    async def snapshot(self, sandbox_id: str, into: Path, mode: str) -> SnapshotResult:
        result = await super().snapshot(sandbox_id, into, mode)
        if self.record:
            result.data[compat.RECORD] = self.here
        return result


@pytest.fixture
def runtime() -> MachineRuntime:  # conftest's ``client`` serves it
    return MachineRuntime()


def _sandbox(client: TestClient, template: str = "base") -> Any:
    return client.post("/v2/sandboxes", json={"templateID": template})


def test_info_reports_the_machine_and_the_warm_templates(client: TestClient) -> None:
    info = client.get("/aenv/info").json()
    assert info["machine"] == TCG and info["warm"] == {"base": 2}


def test_a_snapshot_shows_its_machine_and_restores_on_it(client: TestClient, runtime: MachineRuntime) -> None:
    sid = _sandbox(client).json()["sandboxID"]
    snap = client.post(f"/sandboxes/{sid}/snapshots", json={}).json()
    assert snap["machine"] == TCG
    assert client.get(f"/snapshots/{snap['snapshotID']}").json()["machine"] == TCG
    assert _sandbox(client, snap["snapshotID"]).status_code == 201


def test_another_machines_snapshot_is_a_409_before_anything_starts(client: TestClient, runtime: MachineRuntime) -> None:
    sid = _sandbox(client).json()["sandboxID"]
    snap = client.post(f"/sandboxes/{sid}/snapshots", json={}).json()["snapshotID"]
    runtime.here = dict(KVM)  # as if the snapshot had come from a TCG node to this KVM one
    calls = list(runtime.calls)
    r = _sandbox(client, snap)
    body = r.json()
    assert r.status_code == 409 and body["code"] == 409 and body["reason"] == "machine"
    assert body["snapshotMachine"] == TCG and body["nodeMachine"] == KVM
    assert "tcg, cpu max, QEMU 7.2" in body["message"] and "kvm, cpu AMD EPYC" in body["message"]
    assert runtime.calls == calls  # nothing restored
    assert [s["sandboxID"] for s in client.get("/v2/sandboxes").json()] == [sid]  # nothing stored
    # a rollback to it is refused the same way, the sandbox untouched
    r = client.post(f"/sandboxes/{sid}/rollback", json={"snapshotID": snap})
    assert r.status_code == 409 and r.json()["reason"] == "machine"
    assert runtime.calls == calls and runtime.sandboxes[sid] == "running"


def test_a_snapshot_without_a_record_restores_anywhere(client: TestClient, runtime: MachineRuntime) -> None:
    runtime.record = False  # taken before snapshots recorded their machine
    sid = _sandbox(client).json()["sandboxID"]
    snap = client.post(f"/sandboxes/{sid}/snapshots", json={}).json()
    assert "machine" not in snap
    runtime.here = dict(KVM)
    assert _sandbox(client, snap["snapshotID"]).status_code == 201

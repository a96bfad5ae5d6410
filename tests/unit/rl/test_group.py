"""``run_group`` / ``arun_group`` when the group's parent fails on the infrastructure side (no server: the SDK's
create and aenv's fork replaced by fakes): the group comes back with every member infra-failed and the
stage named, instead of raising and losing the group's rollouts."""

from __future__ import annotations

import asyncio
from typing import Any

import e2b
import pytest
from e2b import ServiceBusyException

from aenv.client import ApiError, ServerUnreachable
from aenv.rl import INFRA_FAILED, _group, arun_group, run_group


class FakeSandbox:
    killed: list[str] = []

    def __init__(self, sandbox_id: str = "parent") -> None:
        self.sandbox_id = sandbox_id
        self.commands = self

    def run(self, cmd: str, **kw: Any) -> Any:
        return type("R", (), {"exit_code": 0, "stdout": "", "stderr": ""})()

    def set_timeout(self, timeout: int) -> None:
        pass

    def kill(self) -> None:
        FakeSandbox.killed.append(self.sandbox_id)


class FakeAsyncSandbox(FakeSandbox):
    async def run(self, cmd: str, **kw: Any) -> Any:  # type: ignore[override]
        return FakeSandbox.run(self, cmd)

    async def set_timeout(self, timeout: int) -> None:  # type: ignore[override]
        pass

    async def kill(self) -> None:  # type: ignore[override]
        FakeSandbox.killed.append(self.sandbox_id)


def _never(*a: Any, **kw: Any) -> float:
    raise AssertionError("no rollout may run")


@pytest.fixture(autouse=True)
def _fresh() -> None:
    FakeSandbox.killed = []


def test_a_parent_create_refused_gives_every_member_infra_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    def create(*a: Any, **kw: Any) -> Any:
        raise ServiceBusyException("503: cluster directory unreachable")

    monkeypatch.setattr(e2b.Sandbox, "create", create)
    res = run_group("base", 4, _never)
    assert [m.index for m in res.members] == [0, 1, 2, 3]
    assert all(m.outcome.status == INFRA_FAILED and m.score is None and m.sandbox_id is None for m in res.members)
    assert res.members[0].outcome.error == "create: ServiceBusyException: 503: cluster directory unreachable"
    assert res.metrics["failed_at"] == "create" and res.kept == []


def test_a_fork_that_cannot_reach_the_gateway_gives_every_member_infra_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(e2b.Sandbox, "create", lambda *a, **kw: FakeSandbox())

    def fork(*a: Any) -> Any:
        raise ServerUnreachable("POST /sandboxes/parent/fork: [Errno 111] Connection refused")

    monkeypatch.setattr(_group, "_fork", fork)
    prepared: list[str] = []
    res = run_group("base", 3, _never, prepare=lambda ep: prepared.append(ep.sandbox_id), keep=1)
    assert prepared == ["parent"] and FakeSandbox.killed == ["parent"]  # the parent still ends with its block
    assert {m.outcome.error for m in res.members} == {
        "fork: ServerUnreachable: POST /sandboxes/parent/fork: [Errno 111] Connection refused"}
    assert res.metrics["failed_at"] == "fork" and "prepare_s" in res.metrics


def test_a_preparation_command_lost_with_its_node_is_named_prepare(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(e2b.Sandbox, "create", lambda *a, **kw: FakeSandbox())

    def prepare(ep: Any) -> None:
        raise e2b.SandboxException("404: sandbox 'parent' is on node n2, which is down")

    res = run_group("base", 2, _never, prepare=prepare)
    assert [m.outcome.error for m in res.members] == [
        "prepare: SandboxException: 404: sandbox 'parent' is on node n2, which is down"] * 2


def test_the_callers_own_bug_in_prepare_still_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(e2b.Sandbox, "create", lambda *a, **kw: FakeSandbox())
    with pytest.raises(ZeroDivisionError):
        run_group("base", 2, _never, prepare=lambda ep: 1 / 0)  # type: ignore[func-returns-value]


def test_arun_group_too(monkeypatch: pytest.MonkeyPatch) -> None:
    async def create(*a: Any, **kw: Any) -> Any:
        return FakeAsyncSandbox()

    def fork(*a: Any) -> Any:
        raise ApiError(503, "cluster directory unreachable")

    monkeypatch.setattr(e2b.AsyncSandbox, "create", create)
    monkeypatch.setattr(_group, "_fork", fork)

    async def never(ep: Any, i: int) -> float:
        raise AssertionError("no rollout may run")

    res = asyncio.run(arun_group("base", 2, never))
    assert [m.outcome.error for m in res.members] == ["fork: ApiError: 503: cluster directory unreachable"] * 2
    assert FakeSandbox.killed == ["parent"]

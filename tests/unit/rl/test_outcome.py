"""``aenv.rl`` without a server: what counts as an infrastructure failure, and who a group keeps."""

from __future__ import annotations

import httpx
from e2b import CommandExitException, RateLimitException, SandboxException, TimeoutException

from aenv.client import ServerUnreachable
from aenv.rl import COMMAND_FAILED, INFRA_FAILED, OK, Outcome, is_infra
from aenv.rl._group import Member, _rank


def test_infra_or_not() -> None:
    for exc in (RateLimitException("429"), TimeoutException("t"), SandboxException("gone"),
                ServerUnreachable("down"), httpx.ConnectError("refused"), ConnectionResetError()):
        assert is_infra(exc), exc
    command = CommandExitException(stdout="", stderr="boom", exit_code=2, error=None)
    for exc in (command, ZeroDivisionError(), KeyError("k")):
        assert not is_infra(exc), exc


def test_an_infra_failure_wins_over_a_command_failure() -> None:
    o = Outcome()
    o.fail_command(1, "bad")
    assert o.status == COMMAND_FAILED and o.exit_code == 1
    o.fail_infra(TimeoutException("lost"))
    assert o.status == INFRA_FAILED and o.infra_failure and "lost" in (o.error or "")
    o.fail_command(2, "")
    assert o.status == INFRA_FAILED and o.error == "exit code 2"


def test_rank_keeps_the_best_scored_and_kills_the_rest() -> None:
    def m(i: int, score: float | None, status: str = OK, sid: str | None = "s") -> Member:
        o = Outcome()
        o.status = status
        return Member(i, None if sid is None else f"s{i}", score, o)

    members = [m(0, 1.0), m(1, 5.0), m(2, 9.0, INFRA_FAILED), m(3, 3.0, COMMAND_FAILED), m(4, None), m(5, 7.0, sid=None)]
    kept, doomed = _rank(members, 2)
    assert kept == ["s1", "s3"]
    assert sorted(doomed) == ["s0", "s2", "s4"]
    assert _rank(members, 0) == ([], ["s0", "s1", "s2", "s3", "s4"])

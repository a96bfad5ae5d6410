"""The chaos scenario's bookkeeping without a cluster: each failure's reason, the counts, the table."""

from __future__ import annotations

from bench.chaos import Rollout, counts_table, reason_of, tally


def test_reasons_name_the_fault_not_the_transport() -> None:
    assert reason_of("SandboxUnreachableException: The sandbox is unreachable: its node n3 (http://10.213.39.13:8000) "
                     "took no connection: ConnectionRefusedError") == "its node is down"
    assert reason_of("SandboxNotRunningException: ...: The sandbox was killed or reached its end of life while the "
                     "request was in flight.") == "sandbox gone mid-call (killed, or its node died)"
    assert reason_of("fork: RemoteProtocolError: Server disconnected without sending a response.") == \
        "fork: connection dropped mid-call"
    # a cut stream whose health probe was then refused was cut first: dropped, not refused
    assert reason_of("SandboxUnreachableException: unexpected EOF during chunk size line: ... health probe failed too "
                     "(tcp connect error: Connection refused)") == "connection dropped mid-call"
    assert reason_of("create: ApiError: 503: cluster directory unreachable") == "cluster directory unavailable (503)"
    assert reason_of("Weird: something else\nsecond line") == "Weird: something else"
    assert reason_of("") == "no reason given"


def test_tally_counts_per_fault_and_flags_what_has_no_reason() -> None:
    rs = [Rollout("redis", 0, 0, "ok"), Rollout("gateway", 0, 0, "infra_failed", "connection dropped mid-call", "x"),
          Rollout("gateway", 0, 1, "infra_failed", "connection dropped mid-call", "x"),
          Rollout("node", 1, 0, "lost", "the group raised", "boom"), Rollout("node", 1, 1, "infra_failed", "", "")]
    t = tally(rs)
    assert t["all"]["rollouts"] == 5 and t["all"]["ok"] == 1 and t["all"]["lost"] == 1
    assert t["gateway"]["infra_reasons"] == {"connection dropped mid-call": 2}
    assert t["node"]["unexplained"] == 1 and t["redis"]["unexplained"] == 0
    table = counts_table(t)
    assert table.splitlines()[0] == "| fault | rollouts | ok | infra-failed | by reason | error | wrong | lost |"
    assert "| gateway | 2 | 0 | 2 | connection dropped mid-call: 2 | 0 | 0 | 0 |" in table

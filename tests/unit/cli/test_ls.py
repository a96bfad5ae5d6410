"""``aenv ls`` for many sandboxes: full IDs in 80 columns, relative times, server-side filters, -q."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

from starlette.testclient import TestClient
from typer.testing import Result

from aenv.cli.listing import count_line, parse_metadata, relative


def _create(client: TestClient, **body: object) -> str:
    resp = client.post("/v2/sandboxes", json={"templateID": "base", **body})
    assert resp.status_code == 201, resp.text
    return str(resp.json()["sandboxID"])


def test_relative_times() -> None:
    now = dt.datetime(2025, 1, 1, 12, 0, 0, tzinfo=dt.UTC)

    def at(seconds: float) -> str:
        return (now + dt.timedelta(seconds=seconds)).isoformat().replace("+00:00", "Z")

    assert relative(at(0), now) == "just now"
    assert relative(at(-42), now) == "42 s ago"
    assert relative(at(-185), now) == "3 min ago"
    assert relative(at(240), now) == "in 4 min"
    assert relative(at(-2 * 3600 - 5), now) == "2 h ago"
    assert relative(at(3 * 86400), now) == "in 3 d"
    assert relative(None, now) == "-"


def test_parse_metadata_names_a_bad_pair() -> None:
    assert parse_metadata(["run=r1", "k=a=b"]) == {"run": "r1", "k": "a=b"}
    for bad in ("novalue", "=v"):
        try:
            parse_metadata([bad])
        except ValueError as exc:
            assert bad in str(exc)
        else:
            raise AssertionError(bad)


def test_ls_full_ids_in_80_columns(client: TestClient, aenv: Callable[..., Result]) -> None:
    long_meta = {"run": "grpo-2025-01-01-very-long-run-name", "policy": "scripted-" + "x" * 40}
    ids = [_create(client, metadata=long_meta, timeout=240) for _ in range(3)]
    result = aenv("ls")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["SANDBOX", "ID", "TEMPLATE", "STATE", "STARTED", "ENDS", "METADATA"]
    assert all(len(line) <= 80 for line in lines), lines
    for sid in ids:
        assert any(line.startswith(sid + " ") for line in lines), (sid, lines)
    assert "just now" in result.output and "in 3 min" in result.output  # 240 s from now, a moment later
    assert "…" in result.output  # the long metadata is shortened, never the IDs


def test_ls_filters_and_quiet(client: TestClient, aenv: Callable[..., Result]) -> None:
    a = [_create(client, metadata={"run": "A", "rank": str(i)}) for i in range(2)]
    b = _create(client, metadata={"run": "B"})
    assert client.post(f"/sandboxes/{b}/pause", json={}).status_code == 204
    result = aenv("ls", "-q", "--metadata", "run=A")
    assert result.exit_code == 0, result.output
    assert sorted(result.output.split()) == sorted(a)
    assert aenv("ls", "-q", "-m", "run=A", "-m", "rank=1").output.split() == [a[1]]
    assert aenv("ls", "-q", "--state", "paused").output.split() == [b]
    assert "paused" in aenv("ls", "-m", "run=B").output
    assert aenv("ls", "-q", "-m", "run=nobody").output == ""
    bad = aenv("ls", "--metadata", "run")
    assert bad.exit_code == 2 and "KEY=VALUE" in bad.output
    bad = aenv("ls", "--state", "dead")
    assert bad.exit_code == 1 and "invalid state 'dead'" in bad.output


def test_ls_count_line_when_long(client: TestClient, aenv: Callable[..., Result]) -> None:
    ids = [_create(client, metadata={"run": "many"}) for _ in range(25)]
    assert client.post(f"/sandboxes/{ids[0]}/pause", json={}).status_code == 204
    result = aenv("ls")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == "25 sandboxes: 1 paused, 24 running"
    assert "SANDBOX ID" not in aenv("ls", "-q").output and len(aenv("ls", "-q").output.split()) == 25
    assert count_line([]) == "0 sandboxes"



def test_rm_by_metadata(client: TestClient, aenv: Callable[..., Result]) -> None:
    tagged = {_create(client, metadata={"run": "X"}) for _ in range(3)}
    keep = _create(client, metadata={"run": "Y"})
    result = aenv("rm", "--metadata", "run=X")
    assert result.exit_code == 0, result.output
    assert set(result.output.split()[:3]) == tagged and "removed 3 sandboxes tagged run=X" in result.output
    assert aenv("ls", "-q").output.split() == [keep]
    assert aenv("rm").exit_code == 2 and aenv("rm", "-m", "run").exit_code == 2
    assert aenv("rm", keep).exit_code == 0 and aenv("ls", "-q").output == ""

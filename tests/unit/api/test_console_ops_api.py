"""The console's operations reads (``/aenv/runs``, ``/aenv/builds``): a team sees its own runs' counters
and builds, never another team's (even under the same run label); an admin sees every team's summed; the
gateway's merges sum counters and list a replayed build once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from aenv.config import Settings
from aenv.gateway.console_ops import merge_builds, merge_runs
from aenv.teams import TeamSpec
from tests.fixtures.runtime import FakeRuntime
from tests.unit.api.conftest import keyed_client

ALICE = {"X-API-KEY": "alice-key"}
BOB = {"X-API-KEY": "bob-key"}
ROOT = {"X-API-KEY": "root-key"}


@pytest.fixture
def teams(settings: Settings, tmp_path: Path) -> Iterator[TestClient]:
    configured = settings.model_copy(update={
        "teams": {"alice": TeamSpec(keys=["alice-key"]), "bob": TeamSpec(keys=["bob-key"], max_sandboxes=1)},
        "admin_keys": ["root-key"],
    })  # fmt: skip
    with keyed_client(configured, FakeRuntime(), tmp_path) as client:
        yield client


def _create(client: TestClient, who: dict[str, str], run: str) -> int:
    return client.post("/v2/sandboxes", json={"templateID": "base", "metadata": {"run": run}}, headers=who).status_code


def test_runs_counts_a_teams_own_runs_only(teams: TestClient) -> None:
    assert _create(teams, ALICE, "r1") == 201
    assert _create(teams, ALICE, "r1") == 201
    assert _create(teams, ALICE, "alice-only") == 201
    assert _create(teams, BOB, "r1") == 201
    assert _create(teams, BOB, "r1") == 429  # bob's quota: a refusal counted for bob's r1
    alice = teams.get("/aenv/runs", headers=ALICE).json()
    assert alice["runKey"] == "run"
    assert alice["runs"]["r1"] == {"events": {"created": 2}, "refused": {}}
    assert "alice-only" in alice["runs"]
    bob = teams.get("/aenv/runs", headers=BOB).json()["runs"]
    assert bob == {"r1": {"events": {"created": 1}, "refused": {"quota": 1}}}  # alice's r1 and alice-only unseen
    everyone = teams.get("/aenv/runs", headers=ROOT).json()["runs"]
    assert everyone["r1"] == {"events": {"created": 3}, "refused": {"quota": 1}}
    # the scrape still sums a run over its teams
    assert 'aenv_run_events_total{run="r1",event="created"} 3' in teams.get("/metrics").text
    assert teams.get("/aenv/runs").status_code == 401


def test_builds_lists_a_teams_own_builds(teams: TestClient) -> None:
    build = teams.post("/v3/templates", json={"name": "alice-tpl", "tags": ["v1"]}, headers=ALICE).json()
    seen = teams.get("/aenv/builds", headers=ALICE).json()
    assert [b["buildID"] for b in seen] == [build["buildID"]]
    assert seen[0]["status"] == "waiting" and seen[0]["alias"] == "alice-tpl" and seen[0]["steps"] == []
    by_template = teams.get("/aenv/builds", params={"templateID": build["templateID"]}, headers=ALICE).json()
    assert [b["buildID"] for b in by_template] == [build["buildID"]]
    assert teams.get("/aenv/builds", params={"templateID": "other"}, headers=ALICE).json() == []
    assert teams.get("/aenv/builds", headers=BOB).json() == []
    assert build["buildID"] not in teams.get("/aenv/builds", params={"templateID": build["templateID"]}, headers=BOB).text
    assert [b["buildID"] for b in teams.get("/aenv/builds", headers=ROOT).json()] == [build["buildID"]]


def test_gateway_merges() -> None:
    runs = merge_runs({"n1": {"runKey": "run", "runs": {"r1": {"events": {"created": 2}, "refused": {}}}},
                       "n2": {"runKey": "run", "runs": {"r1": {"events": {"created": 1, "killed": 1},
                                                              "refused": {"quota": 3}}}}})  # fmt: skip
    assert runs == {"runKey": "run", "runs": {"r1": {"events": {"created": 3, "killed": 1}, "refused": {"quota": 3}}}}
    one = {"buildID": "b1", "templateID": "t", "startedAt": "2026-01-01T00:00:00+00:00"}
    builds = merge_builds({"n1": [{**one, "status": "ready"}], "n2": [{**one, "status": "building"}]})
    assert len(builds) == 1 and builds[0]["status"] == "building" and builds[0]["nodes"] == {"n1": "ready", "n2": "building"}
    failed = merge_builds({"n1": [{**one, "status": "error"}], "n2": [{**one, "status": "ready"}]})
    assert failed[0]["status"] == "error"

"""The console at the HTTP edge (fake runtime): its page and files, log in and out with an httpOnly cookie,
the cookie acting as the key (reads alone; changes with the console's header), and its read routes
(summary, checkpoint graph, events) showing a team its own objects only."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from aenv.api import sse
from aenv.api.console.routes import VENDOR
from aenv.api.routes_console import EventHub
from aenv.config import Settings
from aenv.store.sqlite import SandboxRow
from aenv.teams import TeamSpec
from tests.fixtures.runtime import FakeRuntime
from tests.unit.api.conftest import keyed_client

ALICE = {"X-API-KEY": "alice-key"}
BOB = {"X-API-KEY": "bob-key"}
CONSOLE = {"X-Aenv-Console": "1"}


@pytest.fixture
def teams(tmp_path: Path) -> Iterator[TestClient]:
    configured = Settings(state_dir=tmp_path / "state", pool_size=0, teams={
        "alice": TeamSpec(keys=["alice-key"]), "bob": TeamSpec(keys=["bob-key"]),
    })  # fmt: skip
    with keyed_client(configured, FakeRuntime(), tmp_path) as client:
        yield client


def _login(client: TestClient, key: str) -> None:
    r = client.post("/console/login", json={"apiKey": key})
    assert r.status_code == 200, r.text
    assert "httponly" in r.headers["set-cookie"].lower() and "samesite=strict" in r.headers["set-cookie"].lower()
    assert key not in r.headers["set-cookie"]


def test_the_page_and_its_files(teams: TestClient) -> None:
    page = teams.get("/console")
    assert page.status_code == 200 and '<script type="module" src="/console/static/app.js">' in page.text
    assert teams.get("/console/static/app.js").headers["content-type"].startswith("text/javascript")
    assert teams.get("/console/static/pages/sandboxes.js").status_code == 200
    # only the console's own files and the listed libraries
    assert teams.get("/console/static/../routes.py").status_code == 404
    assert teams.get("/console/static/%2e%2e/routes.py").status_code == 404
    assert teams.get("/console/vendor/lodash.js").status_code == 404
    lib = teams.get("/console/vendor/xterm.js")
    assert lib.status_code in (200, 503)  # 503 names the set-up step when npm ci has not run
    if lib.status_code == 503:
        assert "setup.sh" in lib.json()["message"]
    assert set(VENDOR) >= {"xterm.js", "uplot.js", "cytoscape.js", "dagre.js", "cytoscape-dagre.js"}


def test_log_in_act_log_out(teams: TestClient) -> None:
    assert teams.get("/console/session").json() == {"open": False, "loggedIn": False, "team": None, "admin": False,
                                                    "role": "node"}  # fmt: skip
    bad = teams.post("/console/login", json={"apiKey": "nope"})
    assert bad.status_code == 401 and set(bad.json()) == {"code", "message"}
    assert teams.post("/console/login", json={}).status_code == 400
    _login(teams, "alice-key")
    assert teams.get("/console/session").json()["team"] == "alice"
    # the cookie reads; a change needs the console's header as well
    assert teams.get("/v2/sandboxes").status_code == 200
    assert teams.post("/v2/sandboxes", json={"templateID": "base"}).status_code == 401
    made = teams.post("/v2/sandboxes", json={"templateID": "base"}, headers=CONSOLE)
    assert made.status_code == 201
    sid = made.json()["sandboxID"]
    assert teams.get(f"/sandboxes/{sid}", headers=BOB).status_code == 404  # alice's, through the cookie
    # a key of its own wins over the cookie
    assert [s["sandboxID"] for s in teams.get("/v2/sandboxes", headers=BOB).json()] == []
    assert teams.post("/console/logout").status_code == 204
    assert teams.get("/v2/sandboxes").status_code == 401
    assert teams.get("/console/session").json()["loggedIn"] is False


def test_summary_and_checkpoints_show_a_teams_own(teams: TestClient) -> None:
    a = teams.post("/v2/sandboxes", json={"templateID": "base", "metadata": {"run": "r1"}}, headers=ALICE).json()
    teams.post("/v2/sandboxes", json={"templateID": "base", "metadata": {"run": "r2"}}, headers=BOB)
    snap = teams.post(f"/sandboxes/{a['sandboxID']}/snapshots", json={}, headers=ALICE).json()["snapshotID"]
    mine = teams.get("/aenv/sandboxes/summary", headers=ALICE).json()
    assert mine["total"] == 1 and mine["byRun"] == {"r1": {"running": 1}} and mine["runKey"] == "run"
    assert teams.get("/aenv/sandboxes/summary", params={"metadata": "run=r2"}, headers=ALICE).json()["total"] == 0
    graph = teams.get("/aenv/checkpoints", headers=ALICE).json()
    ids = {n["id"] for n in graph["nodes"]}
    assert {a["sandboxID"], snap, "template:base"} <= ids
    assert {"source": snap, "target": a["sandboxID"]} in graph["edges"]  # snapshotted: its lineage head
    assert teams.get("/aenv/checkpoints", headers=BOB).json()["nodes"][0]["kind"] == "template"
    assert snap not in teams.get("/aenv/checkpoints", headers=BOB).text
    assert teams.get("/aenv/checkpoints", params={"root": snap}, headers=BOB).json()["nodes"] == []


def _row(sid: str, owner: str) -> SandboxRow:
    return SandboxRow(id=sid, template_id="base", state="running", runtime="fake", started_at=0.0, end_at=0.0,  # type: ignore[arg-type]
                      cpu_count=1, memory_mb=512, disk_mb=1024, owner=owner)  # fmt: skip


def test_event_stream_carries_a_teams_own_events() -> None:
    async def go() -> list[bytes]:
        hub = EventHub()
        got: list[bytes] = []

        async def read(team: str | None) -> None:
            async for chunk in hub.stream(team):
                got.append(chunk)
                if len(got) == 3:
                    return

        reader = asyncio.create_task(read("alice"))
        await asyncio.sleep(0.01)
        hub.on_event("created", _row("sbx-bob", "bob"), {})
        hub.on_event("created", _row("sbx-alice", "alice"), {})
        hub.on_event("killed", _row("sbx-alice", "alice"), {"reason": "timeout"})
        await asyncio.wait_for(reader, 5)
        return got

    got = asyncio.run(go())
    assert got[0].startswith(b"retry:")
    assert b"sbx-bob" not in b"".join(got)
    assert b'"event":"created"' in got[1] and b"sbx-alice" in got[1] and b"_owner" not in got[1]
    assert b"\"startedAt\"" in got[1] and b"\"cpuCount\":1" in got[1]  # what a table row shows, from the event
    assert b'"reason":"timeout"' in got[2]


def test_a_slow_reader_is_told_to_reload() -> None:
    async def go() -> list[bytes | None]:
        hub = EventHub()
        hub.loop = asyncio.get_running_loop()
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(2)
        hub.readers.add((queue, None))
        for i in range(5):
            hub._deliver("", sse.frame("lifecycle", {"event": "created", "sandboxID": f"s{i}"}))
        return [queue.get_nowait() for _ in range(queue.qsize())]

    got = asyncio.run(go())
    assert sse.RESYNC in got  # the resync marker

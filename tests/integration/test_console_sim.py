"""The console through the real gateway over simulated nodes (``aenv.testing.simnode``, as ``console-sim``
benches it): the gateway's merged list pages every node's sandboxes once, its merged event stream carries
each node's lifecycle events, and in Chromium the sandbox table shows the SDK's sandboxes with their
node, then a new one, a pause and a kill live, without a reload. Skipped without redis-server."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import Sandbox

from aenv.testing.server import API_KEY
from bench.cluster_sim import SimCluster
from bench.console_probe import SseParser
from tests.fixtures.browser import browser  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(300)

KEY = {"X-API-KEY": API_KEY}
WAIT_MS = 20_000


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    c = SimCluster(tmp_path_factory.mktemp("console-sim"), 3)
    try:
        c.start()
        yield c.gateways(1)[0]
    finally:
        c.close()


def _sdk(url: str) -> dict[str, Any]:
    return {"api_key": API_KEY, "api_url": url, "sandbox_url": url}


def test_the_merged_list_pages_every_node_once_and_the_summary_sums(gw: str) -> None:
    run = "paging"
    made = {Sandbox.create("base", metadata={"run": run}, timeout=600, **_sdk(gw)).sandbox_id for _ in range(23)}
    with httpx.Client(base_url=gw, headers=KEY, trust_env=False, timeout=30) as client:
        seen: list[str] = []
        nodes: set[str] = set()
        token: str | None = None
        while True:
            params = {"limit": "5", "metadata": f"run={run}", **({"nextToken": token} if token else {})}
            resp = client.get("/v2/sandboxes", params=params)
            assert resp.status_code == 200, resp.text
            page = resp.json()
            assert len(page) <= 5
            seen += [s["sandboxID"] for s in page]
            nodes |= {s["node"] for s in page}
            starts = [s["startedAt"] for s in page]
            assert starts == sorted(starts, reverse=True)  # newest first across the nodes
            token = resp.headers.get("X-Next-Token")
            if not token:
                break
        assert sorted(seen) == sorted(made) and len(nodes) > 1
        summary = client.get("/aenv/sandboxes/summary", params={"metadata": f"run={run}"}).json()
        assert summary["total"] == 23 and summary["byRun"] == {run: {"running": 23}}
        assert sum(summary["byNode"].values()) == 23
        assert client.get("/v2/sandboxes", params={"state": "gone"}).status_code == 400  # a node's 400, relayed
        killed = client.delete("/aenv/sandboxes", params={"metadata": f"run={run}"}).json()["killed"]
        assert sorted(killed) == sorted(made)


def test_the_gateway_merges_every_nodes_events(gw: str) -> None:
    got: list[dict[str, Any]] = []
    parser = SseParser()
    with httpx.Client(base_url=gw, headers=KEY, trust_env=False, timeout=httpx.Timeout(10, read=10)) as client, \
            client.stream("GET", "/aenv/events") as resp:  # fmt: skip
        sbx = [Sandbox.create("base", metadata={"run": "events"}, **_sdk(gw)) for _ in range(6)]
        client.post(f"/sandboxes/{sbx[0].sandbox_id}/pause").raise_for_status()
        sbx[1].kill()
        for line in resp.iter_lines():
            if (event := parser.feed(line)) is not None and event[0] == "lifecycle":
                got.append(json.loads(event[1]))
            if len(got) == 8:
                break
    kinds = sorted((e["event"], e["sandboxID"]) for e in got)  # nodes' streams interleave in any order
    assert kinds == sorted([*(("created", s.sandbox_id) for s in sbx), ("paused", sbx[0].sandbox_id),
                            ("killed", sbx[1].sandbox_id)])  # fmt: skip
    assert len({e["node"] for e in got}) > 1 and all(e["metadata"] == {"run": "events"} for e in got)
    httpx.delete(f"{gw}/aenv/sandboxes", params={"metadata": "run=events"}, headers=KEY, trust_env=False)


def test_the_console_over_sim_nodes_shows_rows_and_live_changes(gw: str, browser: Any) -> None:  # noqa: F811
    run = "browser"
    first = [Sandbox.create("base", metadata={"run": run}, **_sdk(gw)) for _ in range(3)]
    page = browser.new_context(viewport={"width": 1400, "height": 900}).new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    page.goto(gw + "/console")
    page.fill("#api-key", API_KEY)
    page.click("#login")
    page.wait_for_function("n => document.querySelectorAll('#sandboxes tr[data-id]').length >= n", arg=3,
                           timeout=WAIT_MS)  # fmt: skip
    row = page.locator(f'#sandboxes tr[data-id="{first[0].sandbox_id}"] td')
    assert row.nth(3).inner_text().startswith("sim")  # the node column: the gateway's session
    new = Sandbox.create("base", metadata={"run": run}, **_sdk(gw))
    page.wait_for_selector(f'#sandboxes tr[data-id="{new.sandbox_id}"]', timeout=WAIT_MS)  # live, no reload
    httpx.post(f"{gw}/sandboxes/{first[1].sandbox_id}/pause", headers=KEY, trust_env=False).raise_for_status()
    page.wait_for_function(f"(document.querySelector('#sandboxes tr[data-id=\"{first[1].sandbox_id}\"]') || {{}})"
                           ".textContent.includes('paused')", timeout=WAIT_MS)  # fmt: skip
    first[2].kill()
    page.wait_for_selector(f'#sandboxes tr[data-id="{first[2].sandbox_id}"]', state="detached", timeout=WAIT_MS)
    page.wait_for_function("document.getElementById('total').textContent === '3'", timeout=WAIT_MS)
    httpx.delete(f"{gw}/aenv/sandboxes", params={"metadata": f"run={run}"}, headers=KEY, trust_env=False)
    assert not errors, errors


def test_the_sim_modules_are_importable_without_the_server_side() -> None:
    """The simnode process stays small: its modules import no FastAPI (the real node's app)."""
    import subprocess
    import sys

    code = "import sys, aenv.testing.simnode; print('fastapi' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[2])  # fmt: skip
    assert out.stdout.strip() == "False"

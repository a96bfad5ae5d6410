"""The console's operations pages in a real browser against a real ``aenv serve`` (ns): templates (a pull
with its progress bar, a build's steps and log), this node's info, runs and leases, a volume's files,
and webhooks (an operator's page: a team key is told so). Each page must show the objects made here,
throw no page errors, and leaves a screenshot in the test artifacts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from aenv.testing.server import API_KEY, Server, kill_sandboxes, start_server, stop_server
from tests.fixtures.browser import browser, shot  # noqa: F401
from tests.fixtures.plugin import PushedImages
from tests.integration.conftest import _needs_runtime

pytestmark = pytest.mark.timeout(300)

TEAM_KEY = "console-team-key-" + "t" * 20
HOOK = "http://127.0.0.1:9/console-hook"  # nothing listens: deliveries stay pending with their error
RUN = "console-run"


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, runtime_name: str, pushed_images: PushedImages) -> Iterator[Server]:
    _needs_runtime(runtime_name)
    pushed_images.require("busybox:latest")
    env = {"AENV_TEAMS": json.dumps({"t": {"keys": [TEAM_KEY]}}), "AENV_ADMIN_KEYS": API_KEY, "AENV_POOL_SIZE": "0",
           "AENV_WEBHOOK_URLS": HOOK, "AENV_REGISTRY_MIRRORS": f"docker.io={pushed_images.registry.url}"}  # fmt: skip
    s = start_server(tmp_path_factory.mktemp("console-pages"), runtime_name, env)
    yield s
    kill_sandboxes(s)
    stop_server(s)


@pytest.fixture(scope="module")
def made(srv: Server) -> dict[str, str]:
    """What the pages show: a lease with a sandbox of a run, a volume with a file, a tagged build."""
    with httpx.Client(base_url=srv.url, headers={"X-API-Key": API_KEY}, timeout=120, trust_env=False) as c:
        lease = c.post("/aenv/leases", json={"ttl": 600, "name": "console-lease"}).json()["leaseID"]
        sbx = c.post("/v2/sandboxes", json={"templateID": "base", "metadata": {"run": RUN, "aenv.lease": lease}})
        assert sbx.status_code == 201, sbx.text
        vol = c.post("/volumes", json={"name": "console-vol"}).json()
        bearer = {"Authorization": f"Bearer {vol['token']}"}
        put = c.put(f"/volumecontent/{vol['volumeID']}/file", params={"path": "/notes.txt"}, content=b"console volume\n",
                    headers=bearer)  # fmt: skip
        assert put.status_code == 201, put.text
        build = c.post("/v3/templates", json={"name": "console-tpl", "tags": ["v1"]}).json()
        steps = [{"type": "RUN", "args": ["echo console-build-line && sleep 2"]}]
        started = c.post(f"/v2/templates/{build['templateID']}/builds/{build['buildID']}",
                         json={"fromTemplate": "base", "steps": steps})  # fmt: skip
        assert started.status_code == 202, started.text
    return {"lease": lease, "sandbox": sbx.json()["sandboxID"], "volume": vol["volumeID"],
            "template": build["templateID"], "build": build["buildID"]}  # fmt: skip


def _login(browser: Any, srv: Server, key: str) -> tuple[Any, list[str]]:  # noqa: F811
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
    page.goto(f"{srv.url}/console")
    page.fill("#api-key", key)
    page.click("#login")
    page.wait_for_selector("#nav", state="visible")
    # the first page (the sandbox list) must be drawn before going on: app.js's router lets a slower earlier
    # page replace a later one
    page.wait_for_selector("#sandbox-table[data-rows]")
    return page, errors


def _visit(page: Any, srv: Server, hash_: str) -> None:
    page.goto(f"{srv.url}/console#/{hash_}")


def test_pages(browser: Any, srv: Server, made: dict[str, str]) -> None:  # noqa: F811
    page, errors = _login(browser, srv, API_KEY)

    _visit(page, srv, "templates")
    page.wait_for_selector(f"[data-template='{made['template']}']")
    page.fill("#pull-image", "busybox:latest")
    page.fill("#pull-name", "console-busybox")
    page.click("#pull")
    page.wait_for_selector("#pull-status:has-text('ready: console-busybox')", timeout=120_000)
    assert page.eval_on_selector("#pull-progress", "p => p.value") == 1
    page.wait_for_selector("#template-list a:text-is('console-busybox')")  # the list is reloaded after the pull
    shot(page, "templates")

    _visit(page, srv, f"template/{made['template']}")
    page.wait_for_selector("[data-tag='v1']", timeout=60_000)  # the tag exists once the build is ready
    page.wait_for_selector(f"[data-build='{made['build']}']")
    page.wait_for_selector("#build-log:has-text('console-build-line')")
    page.wait_for_selector("#build-status:has-text('ready')")
    assert "RUN" in page.inner_text("#build-detail")
    shot(page, "template")

    _visit(page, srv, "nodes")
    page.wait_for_selector("#node-version")
    assert "Capabilities" in page.inner_text("main") and "ns" in page.inner_text("#node-info")
    shot(page, "nodes")

    _visit(page, srv, "runs")
    page.wait_for_selector(f"[data-lease='{made['lease']}']")
    assert page.inner_text(f"[data-live='{RUN}']") == "1 running"
    assert "console-lease" in page.inner_text("#leases")
    shot(page, "runs")

    _visit(page, srv, "volumes")
    page.click(f"[data-browse='{made['volume']}']")
    page.click("[data-read='notes.txt']")
    page.wait_for_selector("#volume-file:has-text('console volume')")
    shot(page, "volumes")

    _visit(page, srv, "webhooks")
    page.wait_for_selector(f"[data-receiver='{HOOK}']")
    page.wait_for_selector("[data-delivery]")
    assert made["sandbox"] in page.inner_text("#deliveries")
    shot(page, "webhooks")
    assert errors == []
    page.close()


def test_a_team_sees_its_own_and_no_operator_page(browser: Any, srv: Server, made: dict[str, str]) -> None:  # noqa: F811
    page, errors = _login(browser, srv, TEAM_KEY)
    _visit(page, srv, "webhooks")
    page.wait_for_selector("#webhooks-forbidden")
    assert "admin_keys" in page.inner_text("#webhooks-forbidden")
    # the browser itself logs the refused request; the page handled it (no script error)
    errors[:] = [e for e in errors if "403 (Forbidden)" not in e]
    shot(page, "webhooks-team")
    _visit(page, srv, "runs")
    page.wait_for_selector("#leases:has-text('No live leases')")
    assert made["lease"] not in page.inner_text("main") and RUN not in page.inner_text("main")
    _visit(page, srv, "volumes")
    page.wait_for_selector("#volumes:has-text('No volumes')")
    time.sleep(0.5)  # a late error from the pages above would show now
    assert errors == []
    page.close()


def test_screenshots_were_saved() -> None:
    from tests.fixtures.browser import artifacts_dir

    for name in ("templates", "template", "nodes", "runs", "volumes", "webhooks"):
        assert Path(artifacts_dir() / f"{name}.png").stat().st_size > 0

"""The web console in a real browser (Debian chromium driven by Playwright), on one node and through a
gateway in front of two nodes (ns), against sandboxes the unmodified E2B SDK creates.

What an operator does: log in with a key (kept in an httpOnly cookie), watch a sandbox appear in the
table without reloading, open its terminal and run a command, fork it from the checkpoint tree and see
the children, and kill a whole run. A screenshot of each page goes to the test run's artifacts.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from e2b import Sandbox

from aenv.testing.gateway import NodeCluster, start_gateway
from aenv.testing.server import API_KEY
from tests.fixtures.browser import browser, shot  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(600)

WAIT_MS = 30_000
KEYS = {"AENV_API_KEYS": API_KEY}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeCluster]:
    if os.geteuid() != 0:
        pytest.skip("the ns runtime needs root")
    c = NodeCluster(tmp_path_factory.mktemp("console"), 2, {**KEYS, "AENV_POOL_SIZE": "1"}, runtime="ns")
    try:
        c.start_node(0)
        c.start_node(1)
        c.gateway = start_gateway(c.tmp, [c.url(0), c.url(1)], KEYS)
        yield c
    finally:
        c.close()


def _url(cluster: NodeCluster, through: str) -> str:
    return cluster.url(0) if through == "node" else cluster.gw


def _page(browser: Any) -> tuple[Any, list[str]]:  # noqa: F811 - the fixture
    page = browser.new_context(viewport={"width": 1400, "height": 900}).new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
    return page, errors


def _login(page: Any, url: str, key: str = API_KEY) -> None:
    page.goto(url + "/console")
    page.fill("#api-key", key)
    page.click("#login")


def test_login_is_required_and_the_key_stays_out_of_the_page(cluster: NodeCluster, browser: Any) -> None:  # noqa: F811
    url = cluster.url(0)
    page, errors = _page(browser)
    page.goto(url + "/console")
    page.wait_for_selector("#api-key")
    shot(page, "login")
    page.fill("#api-key", "not-a-key")
    page.click("#login")
    page.wait_for_function("document.querySelector('#login-note').textContent.includes('Invalid API key')")
    page.fill("#api-key", API_KEY)
    page.click("#login")
    page.wait_for_selector("#sandboxes, #no-sandboxes", timeout=WAIT_MS)
    cookies = page.context.cookies()
    session = [c for c in cookies if c["name"] == "aenv_console"]
    assert session and session[0]["httpOnly"] and session[0]["sameSite"] == "Strict"
    assert API_KEY not in session[0]["value"]
    assert page.evaluate("document.cookie") == ""  # nothing a script could read
    # the cookie alone acts for reads; a change needs the console's header too (no cross-site form post)
    jar = {"aenv_console": session[0]["value"]}
    assert httpx.get(url + "/v2/sandboxes", cookies=jar, trust_env=False).status_code == 200
    assert httpx.post(url + "/v2/sandboxes", cookies=jar, json={"templateID": "base"}, trust_env=False).status_code == 401
    page.click("#logout")
    page.wait_for_selector("#api-key")
    assert httpx.get(url + "/v2/sandboxes", cookies=jar, trust_env=False).status_code == 401
    assert not _unexpected(errors), errors


@pytest.mark.parametrize("through", ["node", "gateway"])
def test_an_operator_watches_a_run(cluster: NodeCluster, browser: Any, through: str) -> None:  # noqa: F811
    url = _url(cluster, through)
    run = f"console-{through}-{uuid.uuid4().hex[:6]}"
    page, errors = _page(browser)
    page.on("dialog", lambda d: d.accept("2") if d.type == "prompt" else d.accept())
    _login(page, url)
    page.wait_for_selector("#sandboxes, #no-sandboxes", timeout=WAIT_MS)
    sdk = {"api_key": API_KEY, "api_url": url, "sandbox_url": url}
    sbx = Sandbox.create("base", metadata={"run": run}, **sdk)
    sid = sbx.sandbox_id
    try:
        # live: the row shows up without a reload
        page.wait_for_selector(f'#sandboxes tr[data-id="{sid}"]', timeout=WAIT_MS)
        if through == "gateway":
            assert page.locator(f'#sandboxes tr[data-id="{sid}"] td').nth(3).inner_text() in ("n1", "n2")
        shot(page, f"sandboxes-{through}")

        # the sandbox's page: its lifecycle, its files, a terminal that runs a command
        sbx.files.write("/home/user/hello.txt", "hello from the SDK")
        page.goto(f"{url}/console#/sandbox/{sid}")
        page.wait_for_selector("#lifecycle >> text=created", timeout=WAIT_MS)
        page.wait_for_selector('#files tr[data-file="hello.txt"]', timeout=WAIT_MS)
        page.click('#files tr[data-file="hello.txt"] >> text=Read')
        page.wait_for_selector("#file-view >> text=hello from the SDK", timeout=WAIT_MS)
        page.click("#open-terminal")
        page.wait_for_selector("#terminal[data-pid]", timeout=WAIT_MS)
        page.wait_for_function("document.querySelector('.xterm-rows').innerText.includes('$')", timeout=WAIT_MS)
        page.keyboard.type("echo console-$((6*7)) > /tmp/from-console; cat /tmp/from-console\n")
        page.wait_for_function("document.querySelector('.xterm-rows').innerText.includes('console-42')", timeout=WAIT_MS)
        assert sbx.files.read("/tmp/from-console").strip() == "console-42"  # the command ran in the sandbox
        shot(page, f"sandbox-{through}")

        # fork from the tree view: the children show up in the tree
        page.goto(f"{url}/console#/checkpoints/{sid}")
        page.wait_for_selector("#tree-fork", timeout=WAIT_MS)
        page.click("#tree-fork")  # the prompt answers 2
        page.wait_for_function("Number(document.querySelector('#graph').dataset.sandboxes) >= 3", timeout=120_000)
        ids = set(page.evaluate("window.aenvTree.ids()"))
        children = {s.sandbox_id for s in Sandbox.list(query=_run(run), **sdk).next_items()} - {sid}
        assert len(children) == 2 and children <= ids
        shot(page, f"checkpoints-{through}")
        if through == "node":  # a snapshot from the tree, a rollback to it, a new sandbox from it
            sbx.files.write("/home/user/step.txt", "before")
            page.evaluate(f"window.aenvTree.select({sid!r})")
            page.click("#tree-snapshot")
            page.wait_for_function("window.aenvTree.ids().length >= 6", timeout=WAIT_MS)  # + the snapshot
            snap = next(n for n in page.evaluate("window.aenvTree.ids()") if n not in ids)
            sbx.files.write("/home/user/step.txt", "after")
            page.evaluate(f"window.aenvTree.select({snap!r})")
            page.select_option("#tree-rollback-target", sid)
            page.click("#tree-rollback")
            page.wait_for_selector("#toast >> text=rollback: done", timeout=WAIT_MS)
            assert sbx.files.read("/home/user/step.txt") == "before"
            page.evaluate(f"window.aenvTree.select({snap!r})")
            page.click("#tree-create")
            page.wait_for_selector("#toast >> text=create: done", timeout=WAIT_MS)
            made = {s.sandbox_id for s in Sandbox.list(**sdk).next_items()} - {sid} - children
            assert made, "a sandbox from the snapshot"
            for other in made:
                Sandbox.kill(other, **sdk)

        # kill the run: every sandbox with its metadata, the children too
        page.goto(f"{url}/console#/sandboxes")
        page.fill("#filter-metadata", f"run={run}")
        page.press("#filter-metadata", "Enter")
        page.wait_for_function("document.querySelectorAll('#sandboxes tr[data-id]').length === 3", timeout=WAIT_MS)
        page.click("#kill-run")  # the confirm is accepted
        page.wait_for_selector("#no-sandboxes", timeout=WAIT_MS)
        assert Sandbox.list(query=_run(run), **sdk).next_items() == []
    finally:
        httpx.delete(f"{url}/aenv/sandboxes", params={"metadata": f"run={run}"}, headers={"X-API-Key": API_KEY},
                     trust_env=False, timeout=60)  # fmt: skip
    assert not _unexpected(errors), errors


def _unexpected(errors: list[str]) -> list[str]:
    """The page's errors, less the 401 of a wrong key the test typed on purpose."""
    return [e for e in errors if not re.search(r"status of 401", e)]


def _run(run: str) -> Any:
    from e2b import SandboxQuery

    return SandboxQuery(metadata={"run": run})


def test_open_server_says_so(tmp_path_factory: pytest.TempPathFactory, browser: Any) -> None:  # noqa: F811
    """Without keys the console asks for none and says the server is open."""
    if os.geteuid() != 0:
        pytest.skip("the ns runtime needs root")
    from aenv.testing.server import start_server, stop_server

    srv = start_server(tmp_path_factory.mktemp("open"), "ns", {"AENV_API_KEYS": "", "AENV_POOL_SIZE": "0"})
    try:
        page, errors = _page(browser)
        page.goto(srv.url + "/console")
        page.wait_for_selector("#open-note", timeout=WAIT_MS)
        assert page.locator("#api-key").count() == 0
        assert not errors, errors
    finally:
        stop_server(srv)

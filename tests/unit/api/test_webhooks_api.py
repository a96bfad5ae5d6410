"""Lifecycle webhooks against a receiver on 127.0.0.1: every event of a sandbox's life, signed; retries
with backoff; deliveries pending when the server died are sent by the next one; the delivery log."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from aenv.api.app import create_app
from aenv.config import Settings
from aenv.core.webhooks import Webhooks, backoff, verify
from aenv.kinds import SandboxState
from aenv.store.sqlite import SandboxRow, Store
from tests.fixtures.runtime import FakeRuntime

SECRET = "s3cret"


class Receiver:
    def __init__(self) -> None:
        self.got: list[tuple[dict[str, str], bytes, float]] = []
        self.fail_first = 0
        recv = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                recv.got.append(({k.lower(): v for k, v in self.headers.items()}, body, time.monotonic()))
                fail = recv.fail_first > 0
                recv.fail_first -= 1
                self.send_response(500 if fail else 204)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def events(self) -> list[tuple[str, str]]:
        """(type, sandbox) in the order the events happened (their ``timestamp``): due deliveries go out
        concurrently, and a retried one arrives late, so arrival order says nothing."""
        bodies = sorted((json.loads(b) for _, b, _ in self.got), key=lambda e: e["timestamp"])
        return [(e["type"], e["sandboxId"]) for e in bodies]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def _app(tmp_path: Path, url: str, **kw: Any) -> Any:
    (tmp_path / "rootfs").mkdir(exist_ok=True)
    s = Settings(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache", reaper_interval=0.05,
                 webhook_urls=[url], webhook_secret=SECRET, webhook_backoff=0.05, **kw)
    return create_app(s, runtime=FakeRuntime(), ensure_base=False)  # type: ignore[arg-type]


def _row(sid: str) -> SandboxRow:
    return SandboxRow(id=sid, template_id="base", state=SandboxState.RUNNING, runtime="fake", started_at=0,
                      end_at=0, cpu_count=1, memory_mb=512, disk_mb=1024)


def _wait(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_lifecycle_events_are_signed_and_logged(tmp_path: Path, receiver: Receiver) -> None:
    app = _app(tmp_path, receiver.url)
    with TestClient(app) as c:
        app.app.state.catalog.register(alias="base", kind="bootstrap", rootfs=tmp_path / "rootfs", template_id="base")
        sid = c.post("/v2/sandboxes", json={"templateID": "base", "metadata": {"run": "r1"}}).json()["sandboxID"]
        assert c.post(f"/sandboxes/{sid}/pause", json={}).status_code == 204
        assert c.post(f"/v2/sandboxes/{sid}/connect", json={"timeout": 60}).status_code in (200, 201)
        resp = c.post(f"/sandboxes/{sid}/fork", json={"count": 2})
        assert resp.status_code in (200, 201), resp.text
        assert c.delete(f"/sandboxes/{sid}").status_code == 204
        _wait(lambda: len(receiver.got) >= 6)
        types = [t for t, s in receiver.events() if s == sid]
        assert types == ["sandbox.lifecycle.created", "sandbox.lifecycle.paused", "sandbox.lifecycle.resumed",
                         "sandbox.lifecycle.killed"]
        forked = [json.loads(b) for _, b, _ in receiver.got if json.loads(b)["type"].endswith("forked")]
        assert len(forked) == 2 and all(f["eventData"] == {"parentSandboxId": sid} for f in forked)
        for headers, body, _ in receiver.got:
            assert verify(SECRET, headers["x-aenv-timestamp"], body, headers["x-aenv-signature"])
            assert not verify("other", headers["x-aenv-timestamp"], body, headers["x-aenv-signature"])
        created = json.loads(receiver.got[0][1])
        assert created["sandboxMetadata"] == {"run": "r1"} and created["sandboxTemplateId"] == "base"
        _wait(lambda: len(c.get("/aenv/webhooks/deliveries", params={"state": "delivered"}).json()) == 6)
        assert c.get("/aenv/webhooks").json()["signed"] is True
        assert c.get("/aenv/webhooks/deliveries", params={"state": "nope"}).status_code == 400


def test_retried_with_backoff_then_failed(tmp_path: Path, receiver: Receiver) -> None:
    receiver.fail_first = 2
    store = Store(tmp_path / "db.sqlite")
    hooks = Webhooks(Settings(state_dir=tmp_path, webhook_urls=[receiver.url], webhook_backoff=0.1,
                              webhook_attempts=3), store)
    row = _row("sbx1")

    async def go() -> None:
        await hooks.start()
        hooks.emit("created", row)
        _deadline = time.monotonic() + 30
        while hooks.deliveries()[0]["state"] == "pending":
            assert time.monotonic() < _deadline
            await asyncio.sleep(0.02)
        await hooks.close()

    asyncio.run(go())
    (d,) = hooks.deliveries()
    assert d["state"] == "delivered" and d["attempts"] == 3 and d["lastStatus"] == 204
    gaps = [b[2] - a[2] for a, b in zip(receiver.got, receiver.got[1:], strict=False)]
    assert gaps[0] >= 0.09 and gaps[1] >= 0.19  # 0.1 s, then doubled
    assert backoff(1.0, 20) == 300.0
    receiver.fail_first = 10
    hooks2 = Webhooks(Settings(state_dir=tmp_path, webhook_urls=[receiver.url], webhook_backoff=0.01,
                               webhook_attempts=2), store)

    async def go2() -> None:
        await hooks2.start()
        hooks2.emit("killed", row)
        _deadline = time.monotonic() + 30
        while any(x["state"] == "pending" for x in hooks2.deliveries()):
            assert time.monotonic() < _deadline
            await asyncio.sleep(0.02)
        await hooks2.close()

    asyncio.run(go2())
    assert [x["state"] for x in hooks2.deliveries("failed")] == ["failed"]
    assert hooks2.deliveries("failed")[0]["lastError"] == "HTTP 500"
    store.close()


def test_pending_deliveries_survive_a_killed_server(tmp_path: Path, receiver: Receiver) -> None:
    """The first server logs the events but dies (kill -9: its sender never ran); the next one sends them."""
    store = Store(tmp_path / "db.sqlite")
    dead = Webhooks(Settings(state_dir=tmp_path, webhook_urls=[receiver.url]), store)
    row = _row("sbx9")
    dead.emit("created", row)
    dead.emit("killed", row)
    store.close()  # nothing was sent
    assert receiver.got == []

    store = Store(tmp_path / "db.sqlite")
    hooks = Webhooks(Settings(state_dir=tmp_path, webhook_urls=[receiver.url]), store)

    async def go() -> None:
        await hooks.start()
        deadline = time.monotonic() + 30
        while len(receiver.got) < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        await hooks.close()

    asyncio.run(go())
    assert sorted(t for t, _ in receiver.events()) == ["sandbox.lifecycle.created", "sandbox.lifecycle.killed"]
    assert all(d["state"] == "delivered" for d in hooks.deliveries())
    store.close()

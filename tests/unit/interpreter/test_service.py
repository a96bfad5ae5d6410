"""The service's routes over its own HTTP server, with bash contexts (no Jupyter needed on the host)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from aenv.interpreter.httpserver import HttpServer
from aenv.interpreter.registry import Registry
from aenv.interpreter.service import Service


@pytest_asyncio.fixture(loop_scope="function")
async def base_url(tmp_path: Path) -> AsyncIterator[str]:
    service = Service(Registry({"PATH": "/usr/bin:/bin"}, str(tmp_path)), envd_port=1, keepalive=0.2)
    server = HttpServer(service, "127.0.0.1", 0)
    port = await server.start()
    serving = asyncio.create_task(server.serve_forever())
    yield f"http://127.0.0.1:{port}"
    serving.cancel()
    await server.aclose()
    await service.aclose()


def _lines(body: str, keepalives: bool = False) -> list[dict[str, object]]:
    """The NDJSON lines of an /execute answer, keepalives left out unless asked for (the fixture
    sends one every 0.2 s, so a slow machine gets some between any two lines)."""
    lines = [json.loads(x) for x in body.splitlines() if x.strip()]
    return [x for x in lines if keepalives or x.get("type") != "keepalive"]


async def test_health(base_url: str) -> None:
    async with httpx.AsyncClient(trust_env=False) as c:
        r = await c.get(f"{base_url}/health")
    assert r.status_code == 200 and r.json() == "OK"


async def test_execute_streams_ndjson_over_one_keepalive_connection(base_url: str) -> None:
    async with httpx.AsyncClient(trust_env=False) as c:
        r1 = await c.post(f"{base_url}/execute", json={"code": "echo out; echo err >&2", "language": "bash"})
        r2 = await c.post(f"{base_url}/execute", json={"code": "sleep 0.5; exit 2", "language": "bash"})
    assert r1.headers["content-type"] == "application/x-ndjson"
    lines = _lines(r1.text)
    assert [x["type"] for x in lines] == ["number_of_executions", "stdout", "stderr", "end_of_execution"]
    types = [x["type"] for x in _lines(r2.text, keepalives=True)]
    assert "keepalive" in types and types[-2:] == ["error", "end_of_execution"]


async def test_contexts_lifecycle_and_404(base_url: str, tmp_path: Path) -> None:
    async with httpx.AsyncClient(trust_env=False) as c:
        ctx = (await c.post(f"{base_url}/contexts", json={"language": "bash", "cwd": "/"})).json()
        assert ctx["language"] == "bash" and ctx["cwd"] == "/"
        r = await c.post(f"{base_url}/execute", json={"code": "pwd", "context_id": ctx["id"]})
        assert _lines(r.text)[1]["text"] == "/\n"
        assert ctx in (await c.get(f"{base_url}/contexts")).json()
        assert (await c.post(f"{base_url}/contexts/{ctx['id']}/restart")).status_code == 204
        assert (await c.delete(f"{base_url}/contexts/{ctx['id']}")).status_code == 204
        missing = await c.post(f"{base_url}/execute", json={"code": "pwd", "context_id": ctx["id"]})
        assert missing.status_code == 404 and ctx["id"] in missing.text
        assert (await c.delete(f"{base_url}/contexts/{ctx['id']}")).status_code == 404


async def test_bad_requests(base_url: str) -> None:
    async with httpx.AsyncClient(trust_env=False) as c:
        both = await c.post(f"{base_url}/execute", json={"code": "1", "context_id": "a", "language": "bash"})
        lang = await c.post(f"{base_url}/execute", json={"code": "1", "language": "cobol"})
        junk = await c.post(f"{base_url}/execute", content=b"{not json")
    assert both.status_code == 400 and lang.status_code == 400 and junk.status_code == 400


async def test_disconnect_interrupts_the_run(base_url: str, tmp_path: Path) -> None:
    marker = tmp_path / "finished"
    async with httpx.AsyncClient(trust_env=False) as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.post(
                f"{base_url}/execute",
                json={"code": f"sleep 3; touch {marker}", "language": "bash"},
                timeout=httpx.Timeout(5, read=0.1),
            )
    async with httpx.AsyncClient(trust_env=False) as c:
        r = await c.post(f"{base_url}/execute", json={"code": "echo next", "language": "bash"}, timeout=5)
    assert _lines(r.text)[1]["text"] == "next\n"
    await asyncio.sleep(3.2)
    assert not marker.exists()

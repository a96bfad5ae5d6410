"""Every route of the newest E2B client the venv has (its generated ``e2b/api/client/api/**``) is in
``docs/E2B_ROUTES.md`` and answers what that table says: served, or a 4xx that names what is not —
never a 405 or a 404 because another route took its path (``/sandboxes/metrics`` read as a sandbox
ID, ``/templates/{id}/tags/count`` caught by ``DELETE /templates/{id:path}``)."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest
from starlette.testclient import TestClient

DOC = Path(__file__).resolve().parents[3] / "docs" / "E2B_ROUTES.md"


def client_routes() -> set[tuple[str, str]]:
    """(METHOD, path template) of every generated call, read from the modules' ``_get_kwargs``."""
    import e2b.api.client.api as api

    out: set[tuple[str, str]] = set()
    for module in Path(api.__file__).parent.glob("*/*.py"):
        text = module.read_text()
        method = re.search(r'"method":\s*"(\w+)"', text)
        url = re.search(r'"url":\s*f?"([^"]+)"', text)
        if method and url:
            out.add((method.group(1).upper(), url.group(1)))
    return out


def documented() -> dict[tuple[str, str], int]:
    """(METHOD, path) -> the status the table says this test's request gets."""
    rows: dict[tuple[str, str], int] = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"\|\s*(GET|POST|PUT|PATCH|DELETE)\s*\|\s*`([^`]+)`\s*\|\s*(\d{3})\s*\|", line)
        if m:
            rows[(m.group(1), m.group(2))] = int(m.group(3))
    return rows


def test_the_table_lists_every_route_of_the_newest_client() -> None:
    routes, table = client_routes(), documented()
    assert len(routes) >= 40  # the generated client was found
    assert routes - set(table) == set(), "routes of the installed e2b client missing from docs/E2B_ROUTES.md"
    assert set(table) - routes == set(), "docs/E2B_ROUTES.md lists routes the installed e2b client does not have"


# What the walk sends where a route takes a body: the smallest request the route serves or names as wrong.
BODIES = {
    ("POST", "/sandboxes"): {"templateID": "base"},
    ("POST", "/v2/sandboxes"): {"templateID": "base"},
    ("POST", "/sandboxes/{sandbox_id}/timeout"): {"timeout": 60},
    ("POST", "/sandboxes/{sandbox_id}/refreshes"): {"duration": 60},
    ("POST", "/sandboxes/{sandbox_id}/connect"): {"timeout": 60},
    ("POST", "/v2/sandboxes/{sandbox_id}/connect"): {"timeout": 60},
    ("POST", "/sandboxes/{sandbox_id}/resume"): {"timeout": 60},
    ("PUT", "/sandboxes/{sandbox_id}/network"): {},
    ("POST", "/templates/tags"): {"target": "base", "tags": ["v2"]},
    ("DELETE", "/templates/tags"): {"name": "base", "tags": ["v2"]},
    ("POST", "/volumes"): {"name": "walk"},
}


@pytest.mark.parametrize(("method", "path"), sorted(documented()))
def test_each_route_answers_what_the_table_says(client: TestClient, method: str, path: str) -> None:
    live = client.post("/v2/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
    values = {"sandbox_id": live, "template_id": "base", "build_id": str(uuid.uuid4()), "hash_": "0" * 64,
              "tag": "v1", "alias": "base", "secret_id": "s1", "volume_id": "vol-unknown"}
    url = path.format(**values)
    query = {"sandbox_ids": live} if path == "/sandboxes/metrics" else {"tag": "v1"} if path.endswith("/exists") else {}
    body = BODIES.get((method, path))
    resp = client.request(method, url, params=query, json=body if body is not None else (
        {} if method in ("POST", "PUT", "PATCH") else None))  # fmt: skip
    want = documented()[(method, path)]
    assert resp.status_code == want, f"{method} {url}: {resp.status_code} {resp.text[:300]}"
    assert resp.status_code not in (405, 500)
    if resp.status_code >= 400:
        err = resp.json()
        assert err["code"] == resp.status_code and err["message"], err  # E2B's error shape, saying why

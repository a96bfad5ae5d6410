"""Hostile input on the control plane: arbitrary JSON, ids, query strings and headers, zero 5xx.

Every REST body route gets (a) arbitrary JSON (and some non-JSON bytes) and (b) objects with the real
field names holding arbitrary values, against a real sandbox and against junk ids. The one property:
the server answers each with a 2xx/4xx carrying the E2B error shape, never a 5xx, and keeps serving.
Valid creates do happen (and are killed at once), so the generators double as a correctness check that
whatever the server accepts it can also serve. The metadata filter gets a round-trip property through
the SDK's own encoding.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import h11
import httpx
import pytest
from e2b import Sandbox, SandboxQuery
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aenv.testing.server import Server
from tests.reliability.helpers import api

EXAMPLES = 60
FUZZ = settings(deadline=None, max_examples=EXAMPLES, suppress_health_check=[HealthCheck.too_slow],
                derandomize=False)
TALLY: dict[str, int] = {}

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=16,
)
junk_ids = st.text(min_size=1, max_size=60) | st.sampled_from(["..", "%2e%2e", "a/b", " ", "\x00", "x" * 5000])


def _bodies(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[bytes]:
    """Arbitrary JSON, raw junk, or an object with the route's real keys holding arbitrary values."""
    shaped = st.fixed_dictionaries({}, optional={k: v | json_values for k, v in fields.items()})
    return st.one_of(
        json_values.map(lambda v: json.dumps(v).encode()),
        shaped.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=200),
        st.just(b'{"timeout": NaN}'),
        st.just(b'{"a":' * 2000),  # deep nesting
    )


def check(resp: httpx.Response, route: str) -> None:
    """No 5xx on the control plane, and every error carries the E2B ``{code, message}`` shape."""
    TALLY[route] = TALLY.get(route, 0) + 1
    assert resp.status_code < 500, f"{route}: {resp.status_code} {resp.text[:300]}"
    if resp.status_code >= 400:
        body = resp.json()
        assert body["code"] == resp.status_code and isinstance(body["message"], str), body


@pytest.fixture(scope="module")
def client(shared_server: Server) -> Iterator[httpx.Client]:
    with api(shared_server, timeout=60) as c:
        yield c
    assert httpx.get(shared_server.url + "/health", trust_env=False).status_code == 200
    print(f"\nmalformed control-plane requests by route: {TALLY} (total {sum(TALLY.values())})")


@pytest.fixture(scope="module")
def victim(client: httpx.Client) -> Iterator[str]:
    """A real sandbox the mutating routes aim at (it may end up paused or timed out: that is fine)."""
    resp = client.post("/v2/sandboxes", json={"templateID": "base", "timeout": 3600})
    assert resp.status_code == 201, resp.text
    sid = resp.json()["sandboxID"]
    yield sid
    client.delete(f"/sandboxes/{sid}")


def _kill_if_created(client: httpx.Client, resp: httpx.Response) -> None:
    if resp.status_code == 201:
        sid = resp.json()["sandboxID"]
        assert client.get(f"/sandboxes/{sid}").status_code == 200
        assert client.delete(f"/sandboxes/{sid}").status_code == 204


CREATE_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "templateID": st.sampled_from(["base", "", "nope", "../base", "base" * 100]),
    "timeout": st.integers(-(2**70), 2**70),
    "metadata": st.dictionaries(st.text(max_size=20), st.text(max_size=40), max_size=5),
    "envVars": st.dictionaries(st.text(max_size=20), st.text(max_size=40), max_size=5),
    "autoPause": st.booleans(),
    "autoResume": st.fixed_dictionaries({"enabled": st.booleans()}),
    "allow_internet_access": st.booleans(),
    "secure": st.booleans(),
    "cpuCount": st.integers(-5, 100),
    "memoryMB": st.integers(-5, 300000),
}


@FUZZ
@given(body=_bodies(CREATE_FIELDS), v2=st.booleans(), key=st.none() | st.text(max_size=300))
def test_create_bodies(client: httpx.Client, body: bytes, v2: bool, key: str | None) -> None:
    headers = {"Content-Type": "application/json"}
    if key is not None and key.isascii() and key.isprintable() and key == key.strip():  # what h11 may send
        headers["Idempotency-Key"] = key
    resp = client.post("/v2/sandboxes" if v2 else "/sandboxes", content=body, headers=headers)
    check(resp, "create")
    _kill_if_created(client, resp)


ROUTES: dict[str, tuple[str, dict[str, st.SearchStrategy[Any]]]] = {
    "timeout": ("/sandboxes/{id}/timeout", {"timeout": st.integers(-(2**40), 2**40)}),
    "refreshes": ("/sandboxes/{id}/refreshes", {"duration": st.integers(-(2**40), 2**40)}),
    "connect": ("/v2/sandboxes/{id}/connect", {"timeout": st.integers(-(2**40), 2**40)}),
    "connect-legacy": ("/sandboxes/{id}/connect", {"timeout": st.integers(-10, 10**6)}),
    "resume": ("/sandboxes/{id}/resume", {"timeout": st.integers(-10, 10**6)}),
    "pause": ("/sandboxes/{id}/pause", {"memory": st.booleans()}),
    "fork": ("/sandboxes/{id}/fork", {"count": st.integers(-3, 200), "timeout": st.integers(-10, 10**6)}),
    "snapshots": ("/sandboxes/{id}/snapshots",
                  {"name": st.text(max_size=40), "mode": st.sampled_from(["full", "filesystem", "x"]),
                   "memory": st.booleans()}),
    "rollback": ("/sandboxes/{id}/rollback", {"snapshotID": st.text(max_size=30)}),
}


@FUZZ
@given(route=st.sampled_from(sorted(ROUTES)), data=st.data(), real=st.booleans())
def test_sandbox_route_bodies(client: httpx.Client, victim: str, route: str, data: st.DataObject, real: bool) -> None:
    path, fields = ROUTES[route]
    body = data.draw(_bodies(fields), label="body")
    sid = victim if real else data.draw(junk_ids, label="id")
    resp = client.post(path.format(id=quote(sid, safe="")), content=body,
                       headers={"Content-Type": "application/json"})
    check(resp, route)
    if route == "fork" and resp.status_code in (200, 201):
        # a list of {"sandbox": {...}, "mode": ..., "snapshotID": ...}: remove the children again
        payload = resp.json()
        for child in payload if isinstance(payload, list) else payload.get("sandboxes", []):
            sandbox = child.get("sandbox", child) if isinstance(child, dict) else {}
            if isinstance(sandbox, dict) and "sandboxID" in sandbox:
                client.delete(f"/sandboxes/{sandbox['sandboxID']}")


@FUZZ
@given(sid=junk_ids, method=st.sampled_from(["GET", "DELETE"]),
       sub=st.sampled_from(["", "/metrics", "/snapshots", "/logs", "/lineage"]),
       params=st.dictionaries(st.sampled_from(["start", "end", "limit", "x"]), st.text(max_size=30), max_size=3))
def test_ids_and_queries(client: httpx.Client, sid: str, method: str, sub: str, params: dict[str, str]) -> None:
    resp = client.request(method, f"/sandboxes/{quote(sid, safe='')}{sub}", params=params)
    check(resp, f"{method} id{sub}")


@FUZZ
@given(metadata=st.text(max_size=200), state=st.text(max_size=30) | st.sampled_from(["running", "paused,running"]),
       limit=st.text(max_size=8) | st.integers(-5, 500).map(str), token=st.text(max_size=30),
       order=st.text(max_size=6), started=st.text(max_size=30), v2=st.booleans())
def test_list_query_junk(client: httpx.Client, metadata: str, state: str, limit: str, token: str, order: str,
                         started: str, v2: bool) -> None:
    params = {"metadata": metadata, "state": state, "limit": limit, "nextToken": token, "order": order,
              "startedAfter": started}
    resp = client.get("/v2/sandboxes" if v2 else "/sandboxes", params=params if v2 else {"metadata": metadata})
    check(resp, "list")


@FUZZ
@given(headers=st.dictionaries(
    st.sampled_from(["X-API-Key", "Content-Type", "Content-Length", "Idempotency-Key", "Authorization", "Host"]),
    st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=80), max_size=3))
def test_header_junk_on_control_plane(shared_server: Server, headers: dict[str, str]) -> None:
    try:
        resp = httpx.post(shared_server.url + "/v2/sandboxes", content=b'{"templateID":"nope"}',
                          headers={"X-API-KEY": "k", **headers}, trust_env=False, timeout=30)
    except (httpx.HTTPError, h11.LocalProtocolError):
        return  # a Content-Length the client itself refuses to honour never reaches the server
    if resp.status_code < 500:
        check(resp, "header junk")
    else:
        raise AssertionError(f"{resp.status_code} {resp.text[:200]}")


metadata_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1,
                        max_size=20)


@settings(deadline=None, max_examples=12)
@given(meta=st.dictionaries(metadata_text, metadata_text, min_size=1, max_size=3))
def test_metadata_filter_round_trip(shared_server: Server, conn: dict[str, str], meta: dict[str, str]) -> None:
    """Whatever metadata a sandbox was created with, the SDK's filter on it finds exactly that sandbox
    (the SDK double-encodes keys and values: ``&``, ``=``, ``%`` and ``+`` must survive)."""
    marker = {"fuzz-round-trip": "1"}
    sbx = Sandbox.create("base", metadata={**meta, **marker}, timeout=120, **conn)
    try:
        found = Sandbox.list(query=SandboxQuery(metadata={**meta, **marker}), **conn).next_items()
        assert [s.sandbox_id for s in found] == [sbx.sandbox_id]
        assert found[0].metadata == {**meta, **marker}
    finally:
        sbx.kill()

"""Template build routes against a fake runtime: shapes, bad input as E2B errors, signed uploads."""

from __future__ import annotations

import hashlib
from urllib.parse import urlsplit

from starlette.testclient import TestClient


def _error(resp, status: int, fragment: str) -> None:  # type: ignore[no-untyped-def]
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["code"] == status and fragment in body["message"], body


def test_request_shares_a_build_in_progress_and_refuses_taken_names(client: TestClient) -> None:
    first = client.post("/v3/templates", json={"name": "tpl-a", "cpuCount": 1, "memoryMB": 512})
    assert first.status_code == 202, first.text
    body = first.json()
    assert body["names"] == ["tpl-a"] and body["templateID"] and body["buildID"] and body["public"] is False
    again = client.post("/v3/templates", json={"name": "tpl-a"}).json()
    assert (again["templateID"], again["buildID"]) == (body["templateID"], body["buildID"])  # one build
    _error(client.post("/v3/templates", json={"name": "base"}), 409, "bootstrap")
    _error(client.post("/v3/templates", json={}), 400, "name")
    _error(client.post("/v3/templates", json={"name": "Bad Name"}), 400, "name")
    _error(client.post("/v3/templates", json={"name": "x", "minFreeDiskMb": 10}), 400, "minFreeDiskMb")
    status = client.get(f"/templates/{body['templateID']}/builds/{body['buildID']}/status").json()
    assert status["status"] == "waiting" and status["logEntries"] == []
    _error(client.get(f"/templates/{body['templateID']}/builds/nope/status"), 404, "nope")


def test_a_gateway_may_give_the_ids(client: TestClient) -> None:
    ids = {"X-Aenv-Build-Ids": "tplgw1 0b7c-build"}
    got = client.post("/v3/templates", json={"name": "tpl-gw"}, headers=ids).json()
    assert (got["templateID"], got["buildID"]) == ("tplgw1", "0b7c-build")
    for bad in ("one", "a b c", "a/b c"):
        _error(client.post("/v3/templates", json={"name": "tpl-gw2"}, headers={"X-Aenv-Build-Ids": bad}), 400,
               "X-Aenv-Build-Ids")  # fmt: skip


def test_start_refuses_what_it_cannot_do(client: TestClient) -> None:
    b = client.post("/v3/templates", json={"name": "tpl-b"}).json()
    url = f"/v2/templates/{b['templateID']}/builds/{b['buildID']}"
    _error(client.post(url, json={"steps": []}), 400, "exactly one")
    _error(client.post(url, json={"fromTemplate": "base", "steps": [{"type": "FROM", "args": ["x"]}]}), 400,
           "unknown step type")
    _error(client.post(url, json={"fromTemplate": "base", "fromImageRegistry": {"type": "registry"}}), 400,
           "fromImageRegistry")
    _error(client.post(url, json={"fromTemplate": "no-such-template"}), 404, "no-such-template")
    _error(client.post(f"/v2/templates/{b['templateID']}/builds/other", json={"fromTemplate": "base"}), 404, "other")


def test_upload_links_are_signed_and_stored_by_hash(client: TestClient) -> None:
    b = client.post("/v3/templates", json={"name": "tpl-c"}).json()
    data = b"not really a tar, but bytes"
    digest = hashlib.sha256(data).hexdigest()
    _error(client.get(f"/templates/{b['templateID']}/files/not-a-hash"), 400, "sha256")
    link = client.get(f"/templates/{b['templateID']}/files/{digest}")
    assert link.status_code == 201 and link.json()["present"] is False
    url = urlsplit(link.json()["url"])
    assert url.path == f"/aenv/build-files/{digest}" and "token=" in url.query
    # without the API key (the SDK sends none there), but not without the token
    anon = TestClient(client.app)
    assert anon.put(url.path, content=data).status_code == 404
    assert anon.put(f"{url.path}?token={'0' * 64}", content=data).status_code == 404
    assert anon.put(f"{url.path}?{url.query}", content=data).status_code == 201
    assert client.get(f"/templates/{b['templateID']}/files/{digest}").json() == {"present": True}

"""Routes the newest E2B client calls that aenv added for it: a sandbox's logs (v1 and v2 shapes, kept
after it ends), batch metrics, and the tag queries — their answers, not only their statuses
(``test_e2b_routes.py`` walks the statuses). The generated client's own models parse each answer."""

from __future__ import annotations

import time

from e2b.api.client.models import SandboxesWithMetrics, SandboxLogs, SandboxLogsV2Response
from e2b.api.client.models.template_tag_exists_response import TemplateTagExistsResponse
from e2b.api.client.models.template_tag_groups_response import TemplateTagGroupsResponse
from e2b.api.client.models.template_tags_count_response import TemplateTagsCountResponse
from starlette.testclient import TestClient


def _create(client: TestClient) -> str:
    resp = client.post("/v2/sandboxes", json={"templateID": "base"})
    assert resp.status_code == 201, resp.text
    return str(resp.json()["sandboxID"])


def test_a_sandboxs_log_tells_its_life_and_outlives_it(client: TestClient) -> None:
    sid = _create(client)
    assert client.post(f"/sandboxes/{sid}/pause").status_code == 204
    assert client.post(f"/sandboxes/{sid}/connect", json={"timeout": 60}).status_code in (200, 201)
    assert client.delete(f"/sandboxes/{sid}").status_code == 204
    v1 = client.get(f"/sandboxes/{sid}/logs")
    assert v1.status_code == 200, v1.text
    lines = [entry.line for entry in SandboxLogs.from_dict(v1.json()).logs]
    assert lines == ["sandbox created from template base", "sandbox paused", "sandbox resumed",
                     "sandbox ended (killed): killed through the API"]
    newest = client.get(f"/v2/sandboxes/{sid}/logs", params={"direction": "backward", "limit": 1})
    assert [e.message for e in SandboxLogsV2Response.from_dict(newest.json()).logs] == [lines[-1]]
    assert client.get(f"/v2/sandboxes/{sid}/logs", params={"level": "warn"}).json() == {"logs": []}
    assert len(client.get(f"/v2/sandboxes/{sid}/logs", params={"search": "paused"}).json()["logs"]) == 1
    later = int((time.time() + 60) * 1000)
    assert client.get(f"/sandboxes/{sid}/logs", params={"start": later}).json()["logs"] == []
    assert client.get(f"/v2/sandboxes/{sid}/logs", params={"level": "loud"}).status_code == 400


def test_an_unknown_sandbox_has_no_log(client: TestClient) -> None:
    resp = client.get("/sandboxes/nosuchsandbox/logs")
    assert resp.status_code == 404 and resp.json()["code"] == 404


def test_batch_metrics_answer_each_known_sandbox(client: TestClient) -> None:
    a, b = _create(client), _create(client)
    resp = client.get("/sandboxes/metrics", params={"sandbox_ids": f"{a},{b},nosuchsandbox"})
    assert resp.status_code == 200, resp.text
    parsed = SandboxesWithMetrics.from_dict(resp.json())
    assert set(parsed.sandboxes) == {a, b} and parsed.sandboxes[a]["cpuCount"] == 2
    assert client.get("/sandboxes/metrics", params={"sandbox_ids": ""}).status_code == 400
    too_many = ",".join(f"s{i}" for i in range(101))
    assert "at most 100" in client.get("/sandboxes/metrics", params={"sandbox_ids": too_many}).json()["message"]


def test_tag_queries_of_a_template_without_builds(client: TestClient) -> None:
    count = TemplateTagsCountResponse.from_dict(client.get("/templates/base/tags/count").json())
    assert count.total == 0
    exists = client.get("/templates/base/tags/exists", params={"tag": "v1"}).json()
    assert TemplateTagExistsResponse.from_dict(exists).exists is False
    groups = TemplateTagGroupsResponse.from_dict(client.get("/templates/base/tags/groups").json())
    assert groups.tags == [] and groups.next_cursor is None
    assert client.get("/templates/nosuch/tags/count").status_code == 404

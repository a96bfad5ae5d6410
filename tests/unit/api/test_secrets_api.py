"""E2B's secrets API at the HTTP edge: CRUD by ID and name, values write-only (in no answer), another
owner's secret answering as an unknown one, E2B-shaped 400s that never repeat a value, paging by
``x-next-token``, and rows that survive a restart (SQLite)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from starlette.testclient import TestClient

from aenv.api.app import create_app
from aenv.config import Settings
from tests.fixtures.runtime import FakeRuntime

VALUE = "sk-unit-" + "7" * 24
A = {"X-API-KEY": "e2b_" + "a" * 40}
B = {"X-API-KEY": "e2b_" + "b" * 40}


def _settings(tmp_path: Path) -> Settings:
    return Settings(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache", api_keys=[A["X-API-KEY"], B["X-API-KEY"]])


class EgressRuntime(FakeRuntime):
    """The fake runtime, taking egress policies (what it got, by sandbox)."""

    def __init__(self) -> None:
        super().__init__()
        self.egress: dict[str, Any] = {}

    async def set_egress(self, sandbox_id: str, policy: Any) -> None:
        self.egress[sandbox_id] = policy


def _client(tmp_path: Path) -> TestClient:
    return TestClient(create_app(_settings(tmp_path), runtime=EgressRuntime(), ensure_base=False))  # type: ignore[arg-type]


def test_crud_by_id_and_name_values_write_only(tmp_path: Path) -> None:
    with _client(tmp_path) as c:
        made = c.post("/secrets", json={"name": "OpenAI-Key", "value": VALUE, "metadata": {"env": "t"}}, headers=A)
        assert made.status_code == 201, made.text
        s = made.json()
        assert s["secretID"].startswith("sec_") and s["name"] == "openai-key" and s["currentVersion"] == 1
        assert s["metadata"] == {"env": "t"} and s["createdAt"] and s["updatedAt"]
        sid = s["secretID"]
        answers = [made]
        answers.append(c.get(f"/secrets/{sid}", headers=A))
        answers.append(c.get("/secrets/OPENAI-KEY", headers=A))
        assert answers[-1].json()["secretID"] == sid
        upd = c.post(f"/secrets/{sid}", json={"value": VALUE + "2"}, headers=A)
        assert upd.status_code == 200 and upd.json()["currentVersion"] == 2 and upd.json()["metadata"] == {"env": "t"}
        answers += [upd, c.get("/secrets", headers=A)]
        assert [x["name"] for x in answers[-1].json()] == ["openai-key"]
        for r in answers:
            assert VALUE not in r.text and "value" not in r.json()
        assert c.post("/secrets", json={"name": "openai-key", "value": "x"}, headers=A).status_code == 409
        assert c.delete("/secrets/openai-key", headers=A).status_code == 204
        assert c.get(f"/secrets/{sid}", headers=A).status_code == 404
        assert c.delete(f"/secrets/{sid}", headers=A).status_code == 404


def test_another_owners_secret_is_unknown(tmp_path: Path) -> None:
    with _client(tmp_path) as c:
        sid = c.post("/secrets", json={"name": "mine", "value": VALUE}, headers=A).json()["secretID"]
        unknown = c.get("/secrets/sec_000000000000000000000000", headers=B)
        for method, path, body in (("GET", f"/secrets/{sid}", None), ("GET", "/secrets/mine", None),
                                   ("POST", f"/secrets/{sid}", {"value": "x"}), ("DELETE", f"/secrets/{sid}", None)):
            got = c.request(method, path, json=body, headers=B)
            assert got.status_code == 404 and got.json()["code"] == 404, (method, path, got.text)
            assert got.json()["message"].replace(path.rsplit("/", 1)[1], "X") == unknown.json()["message"].replace(
                "sec_000000000000000000000000", "X")
        assert c.get("/secrets", headers=B).json() == []
        assert c.post("/secrets", json={"name": "mine", "value": "v"}, headers=B).status_code == 201  # per owner
        assert c.get("/secrets", headers={"X-API-KEY": "wrong"}).status_code == 401


def test_bad_input_is_an_e2b_400_without_the_value(tmp_path: Path) -> None:
    with _client(tmp_path) as c:
        for body in ({"name": "a{b", "value": "v"}, {"name": "", "value": "v"}, {"name": "sec_x", "value": "v"},
                     {"name": "ok", "value": ""}, {"name": "ok", "value": VALUE + "\r\nX-Evil: 1"},
                     {"name": "ok", "value": "v", "metadata": {str(i): "v" for i in range(33)}},
                     {"name": "ok", "value": "v", "extra": 1}, {"name": "ok"}, {"name": "ok", "value": 5}):
            got = c.post("/secrets", json=body, headers=A)
            assert got.status_code == 400, (body, got.text)
            assert set(got.json()) == {"code", "message"} and got.json()["code"] == 400
            assert VALUE not in got.text
        assert c.get("/secrets?nextToken=%%%", headers=A).status_code == 400


def test_paging_and_persistence(tmp_path: Path) -> None:
    with _client(tmp_path) as c:
        for n in ("c", "a", "b"):
            assert c.post("/secrets", json={"name": n, "value": VALUE}, headers=A).status_code == 201
        first = c.get("/secrets?limit=2", headers=A)
        assert [s["name"] for s in first.json()] == ["a", "b"]
        rest = c.get(f"/secrets?limit=2&nextToken={first.headers['x-next-token']}", headers=A)
        assert [s["name"] for s in rest.json()] == ["c"] and "x-next-token" not in rest.headers
    with _client(tmp_path) as c:  # a new server on the same state dir
        assert [s["name"] for s in c.get("/secrets", headers=A).json()] == ["a", "b", "c"]
        store = c.app.app.state.orchestrator  # type: ignore[attr-defined]
        sid = c.get("/secrets/a", headers=A).json()["secretID"]
        assert store.secrets.value_of(sid) == VALUE
    db = (tmp_path / "state" / "aenv.db").read_bytes()
    assert b"sk-unit-" in db  # stored in the database itself, not only in memory (kill -9 keeps it)


def test_rules_bind_the_owners_secrets_and_are_masked(tmp_path: Path) -> None:
    rules = {"api.example.com": [{"transform": {"headers": {"Authorization": "Bearer ${e2b.secrets.key}",
                                                            "X-Literal": "lit-" + VALUE}}}]}
    with _client(tmp_path) as c:
        c.app.app.state.catalog.register(alias="base", kind="bootstrap", rootfs=tmp_path, template_id="base")  # type: ignore[attr-defined]
        sid = c.post("/secrets", json={"name": "key", "value": VALUE}, headers=A).json()["secretID"]
        refused = c.post("/v2/sandboxes", json={"templateID": "base", "network": {"rules": rules}}, headers=B)
        assert refused.status_code == 400 and "secret 'key' not found" in refused.json()["message"]  # B's: none
        made = c.post("/v2/sandboxes", json={"templateID": "base", "network": {"rules": rules}}, headers=A)
        assert made.status_code == 201, made.text
        box = made.json()["sandboxID"]
        detail = c.get(f"/sandboxes/{box}", headers=A)
        assert detail.json()["network"]["rules"] == {
            "api.example.com": [{"transform": {"headers": {"Authorization": "***", "X-Literal": "***"}}}]}
        assert VALUE not in detail.text and sid not in detail.text
        row = c.app.app.state.orchestrator.get(box).row  # type: ignore[attr-defined]
        assert row.network["secretIDs"] == {"key": sid} and VALUE not in str({**row.network, "rules": None})
        upd = c.put(f"/sandboxes/{box}/network", json={"rules": {"x.example.com": [
            {"transform": {"headers": {"X": "${e2b.secrets.missing}"}}}]}}, headers=A)
        assert upd.status_code == 400 and "missing" in upd.json()["message"]

"""E2B volumes at the HTTP edge against a fake runtime: the control plane, the volume content API
with its token, E2B-shaped errors and unknown fields named, mount rules (one writer, read-only
readers, fork children read-only), persistence across a restart."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from aenv.api.app import create_app
from aenv.config import Settings
from aenv.runtime.base import RuntimeState, SandboxSpec, VolumeCapable
from tests.fixtures.runtime import FakeRuntime


class MountingRuntime(FakeRuntime):
    """The fake runtime, able to mount volumes: records the binds each create got."""

    name = "fake-mounting"

    def __init__(self) -> None:
        super().__init__()
        self.binds: dict[str, tuple[Any, ...]] = {}

    def make_volume_dir(self, path: Path, limit_mb: int) -> None:
        path.mkdir(exist_ok=True)

    def remove_volume_dir(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)

    async def create(self, spec: SandboxSpec) -> RuntimeState:
        self.binds[spec.sandbox_id] = spec.volumes
        return await super().create(spec)

    async def create_from_snapshot(self, spec: SandboxSpec, snapshot: Path, result: Any) -> RuntimeState:
        self.binds[spec.sandbox_id] = spec.volumes
        return await super().create_from_snapshot(spec, snapshot, result)


@pytest.fixture
def mounting() -> MountingRuntime:
    rt = MountingRuntime()
    assert isinstance(rt, VolumeCapable)
    return rt


def _app_client(settings: Settings, runtime: FakeRuntime, tmp_path: Path) -> Iterator[TestClient]:
    app = create_app(settings, runtime=runtime, ensure_base=False)  # type: ignore[arg-type]
    with TestClient(app) as c:
        app.app.state.catalog.register(alias="base", kind="bootstrap", rootfs=tmp_path / "rootfs", template_id="base")
        yield c


@pytest.fixture
def vclient(settings: Settings, mounting: MountingRuntime, tmp_path: Path) -> Iterator[TestClient]:
    yield from _app_client(settings, mounting, tmp_path)


def _volume(client: TestClient, name: str = "data") -> dict[str, Any]:
    resp = client.post("/volumes", json={"name": name})
    assert resp.status_code == 201, resp.text
    body: dict[str, Any] = resp.json()
    assert set(body) == {"volumeID", "name", "token"}
    return body


def _error(resp: Any, status: int, *fragments: str) -> None:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["code"] == status and isinstance(body["message"], str)
    for f in fragments:
        assert f in body["message"], body["message"]


def _create(client: TestClient, mounts: list[dict[str, Any]]) -> Any:
    return client.post("/v2/sandboxes", json={"templateID": "base", "volumeMounts": mounts})


# ---- control plane ------------------------------------------------------------------------------
def test_create_get_list_destroy(client: TestClient, settings: Settings) -> None:
    vol = _volume(client)
    assert (settings.volumes_dir / vol["volumeID"]).is_dir()
    assert client.get(f"/volumes/{vol['volumeID']}").json() == vol
    assert client.get("/volumes").json() == [{"volumeID": vol["volumeID"], "name": "data"}]
    assert client.delete(f"/volumes/{vol['volumeID']}").status_code == 204
    assert not (settings.volumes_dir / vol["volumeID"]).exists()
    _error(client.get(f"/volumes/{vol['volumeID']}"), 404, vol["volumeID"])
    _error(client.delete(f"/volumes/{vol['volumeID']}"), 404)
    assert client.get("/volumes").json() == []


def test_bad_volume_requests(client: TestClient) -> None:
    _volume(client, "taken")
    _error(client.post("/volumes", json={"name": "taken"}), 409, "taken")
    _error(client.post("/volumes", json={"name": "bad/name"}), 400, "name")
    _error(client.post("/volumes", json={"name": "x:ro"}), 400, "name")
    _error(client.post("/volumes", json={"name": "v", "sizeGB": 5}), 400, "sizeGB")
    _error(client.post("/volumes", json={}), 400, "name")
    _error(client.post("/volumes", content=b"{not json", headers={"content-type": "application/json"}), 400)


def test_volumes_survive_a_restart(settings: Settings, tmp_path: Path) -> None:
    first = _app_client(settings, FakeRuntime(), tmp_path)
    c = next(first)
    vol = _volume(c, "keep")
    c.put(f"/volumecontent/{vol['volumeID']}/file", params={"path": "/a.txt"}, content=b"hi",
          headers={"Authorization": f"Bearer {vol['token']}"})
    first.close()
    second = _app_client(settings, FakeRuntime(), tmp_path)
    c = next(second)
    assert c.get(f"/volumes/{vol['volumeID']}").json() == vol
    got = c.get(f"/volumecontent/{vol['volumeID']}/file", params={"path": "/a.txt"},
                headers={"Authorization": f"Bearer {vol['token']}"})
    assert got.content == b"hi"
    second.close()


# ---- content API --------------------------------------------------------------------------------
def test_content_needs_the_volume_token(client: TestClient) -> None:
    vol = _volume(client)
    url = f"/volumecontent/{vol['volumeID']}/path"
    _error(client.get(url, params={"path": "/"}), 404)
    _error(client.get(url, params={"path": "/"}, headers={"Authorization": "Bearer wrong"}), 404)
    ok = client.get(url, params={"path": "/"}, headers={"Authorization": f"Bearer {vol['token']}"})
    assert ok.status_code == 200 and ok.json()["type"] == "directory"


def test_content_validation(client: TestClient) -> None:
    vol = _volume(client)
    h = {"Authorization": f"Bearer {vol['token']}"}
    base = f"/volumecontent/{vol['volumeID']}"
    _error(client.get(f"{base}/path", params={"path": "/", "follow": "1"}, headers=h), 400, "follow")
    _error(client.get(f"{base}/path", headers=h), 400, "path")
    _error(client.put(f"{base}/file", params={"path": "/f", "mode": "rw"}, content=b"", headers=h), 400, "mode")
    _error(client.put(f"{base}/file", params={"path": "/f", "mode": "99999"}, content=b"", headers=h), 400, "mode")
    _error(client.put(f"{base}/file", params={"path": "/f", "force": "yes"}, content=b"", headers=h), 400, "force")
    _error(client.patch(f"{base}/path", params={"path": "/"}, json={"owner": 1}, headers=h), 400, "owner")
    _error(client.get(f"{base}/dir", params={"path": "/", "depth": "0"}, headers=h), 400, "depth")
    _error(client.delete(f"{base}/path", params={"path": "/"}, headers=h), 400, "root")


def test_content_operations(client: TestClient) -> None:
    vol = _volume(client)
    h = {"Authorization": f"Bearer {vol['token']}"}
    base = f"/volumecontent/{vol['volumeID']}"
    w = client.put(f"{base}/file", params={"path": "/a.txt", "mode": "416"}, content=b"hello", headers=h)
    assert w.status_code == 201 and w.json()["size"] == 5 and w.json()["mode"] == 0o640, w.text
    _error(client.put(f"{base}/file", params={"path": "/a.txt"}, content=b"x", headers=h), 409, "exists")
    assert client.put(f"{base}/file", params={"path": "/a.txt", "force": "true"}, content=b"x", headers=h).status_code == 201
    assert client.get(f"{base}/file", params={"path": "/a.txt"}, headers=h).content == b"x"
    _error(client.put(f"{base}/file", params={"path": "/no/such/a"}, content=b"", headers=h), 404)
    assert client.post(f"{base}/dir", params={"path": "/d/e", "force": "true"}, headers=h).status_code == 201
    _error(client.post(f"{base}/dir", params={"path": "/d"}, headers=h), 409)
    _error(client.post(f"{base}/dir", params={"path": "/x/y"}, headers=h), 404)
    names = [e["path"] for e in client.get(f"{base}/dir", params={"path": "/", "depth": "2"}, headers=h).json()]
    assert names == ["/a.txt", "/d", "/d/e"]
    patched = client.patch(f"{base}/path", params={"path": "/a.txt"}, json={"mode": 0o600, "uid": 7}, headers=h)
    assert patched.json()["mode"] == 0o600 and patched.json()["uid"] == 7
    assert client.delete(f"{base}/path", params={"path": "/d"}, headers=h).status_code == 204
    _error(client.get(f"{base}/path", params={"path": "/d/e"}, headers=h), 404)
    _error(client.get(f"{base}/path", params={"path": "/../../etc/passwd"}, headers=h), 404)


# ---- mounts -------------------------------------------------------------------------------------
def test_one_writer_many_readers(vclient: TestClient, mounting: MountingRuntime, settings: Settings) -> None:
    _volume(vclient, "shared")
    w = _create(vclient, [{"name": "shared", "path": "/mnt/data"}])
    assert w.status_code == 201, w.text
    writer = w.json()["sandboxID"]
    (bind,) = mounts = mounting.binds[writer]
    assert bind.path == "/mnt/data" and not bind.read_only and bind.source.parent == settings.volumes_dir
    _error(_create(vclient, [{"name": "shared", "path": "/data"}]), 409, "shared", writer, "read-only")
    r1 = _create(vclient, [{"name": "shared:ro", "path": "/data"}])
    r2 = _create(vclient, [{"name": "shared", "path": "/data", "readOnly": True}])
    assert r1.status_code == r2.status_code == 201
    assert all(b.read_only for b in mounting.binds[r1.json()["sandboxID"]])
    detail = vclient.get(f"/sandboxes/{writer}").json()
    assert detail["volumeMounts"] == [{"name": "shared", "path": "/mnt/data"}]
    vid = vclient.get("/volumes").json()[0]["volumeID"]
    _error(vclient.delete(f"/volumes/{vid}"), 409, writer)
    assert vclient.delete(f"/sandboxes/{writer}").status_code == 204
    again = _create(vclient, [{"name": "shared", "path": "/w"}])  # the writer's place is free again
    assert again.status_code == 201 and not mounting.binds[again.json()["sandboxID"]][0].read_only
    assert mounts  # (the first writer's binds were what it was made with)


def test_fork_children_mount_read_only(vclient: TestClient, mounting: MountingRuntime) -> None:
    _volume(vclient, "shared")
    sid = _create(vclient, [{"name": "shared", "path": "/mnt/data"}]).json()["sandboxID"]
    resp = vclient.post(f"/sandboxes/{sid}/fork", json={"count": 2})
    assert resp.status_code == 201, resp.text
    for r in resp.json():
        kid = r["sandbox"]["sandboxID"]
        assert [(b.path, b.read_only) for b in mounting.binds[kid]] == [("/mnt/data", True)]
    assert not mounting.binds[sid][0].read_only


@pytest.mark.parametrize(
    ("mounts", "status", "named"),
    [
        ([{"name": "nope", "path": "/data"}], 404, "nope"),
        ([{"name": "shared", "path": "data"}], 400, "absolute"),
        ([{"name": "shared", "path": "/"}], 400, "volumeMounts"),
        ([{"name": "shared", "path": "/proc/x"}], 400, "reserved"),
        ([{"name": "shared", "path": "/.aenv"}], 400, "reserved"),
        ([{"name": "shared", "path": "/a"}, {"name": "other", "path": "/a/b"}], 400, "inside"),
        ([{"name": "shared", "path": "/a"}, {"name": "shared:ro", "path": "/b"}], 400, "twice"),
        ([{"name": "shared", "path": "/a", "subPath": "x"}], 400, "volumeMounts[0].subPath"),
        ([{"name": "shared"}], 400, "path"),
    ],
    ids=lambda v: str(v),
)
def test_bad_mounts(vclient: TestClient, mounting: MountingRuntime, mounts: list[dict[str, Any]],
                    status: int, named: str) -> None:
    _volume(vclient, "shared")
    _volume(vclient, "other")
    _error(_create(vclient, mounts), status, named)
    assert mounting.calls == []


def test_a_runtime_that_cannot_mount_says_so(client: TestClient, runtime: FakeRuntime) -> None:
    _volume(client, "shared")
    _error(_create(client, [{"name": "shared", "path": "/data"}]), 400, "volumeMounts", "does not mount")
    assert runtime.calls == []

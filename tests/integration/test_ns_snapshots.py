"""Snapshots, fork and rollback on the ns runtime, through the real server and the unmodified e2b SDK.

What ns honours (``runtime/ns/snapshot.py``): filesystem snapshots always; process snapshots only with
a working CRIU >= 4.2 (absent here: a full snapshot is refused with 409, fork runs as a filesystem
fork and says so). No wall-clock assertions.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from aenv.runtime.ns import criu
from aenv.testing.server import API_KEY, KEEP_SANDBOXES, Server, start_server, stop_server

pytestmark = pytest.mark.skipif(os.environ.get("AENV_TEST_RUNTIME", "ns") != "ns", reason="ns runtime suite")

HEADERS = {"X-API-KEY": API_KEY}
CRIU = criu.probe()


def api(server: Server, method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(method, server.url + path, headers=HEADERS, trust_env=False, timeout=120, **kw)


def snapshot_row(server: Server, snapshot_id: str) -> dict[str, Any]:
    r = api(server, "GET", f"/snapshots/{snapshot_id}")
    assert r.status_code == 200, r.text
    return dict(r.json())


def snapshot_dir(server: Server, snapshot_id: str) -> Path:
    """Where a snapshot's files are: in the server's state directory, or, behind a gateway, in that of
    the node the gateway says holds it (``X-Aenv-Node``)."""
    node = api(server, "GET", f"/snapshots/{snapshot_id}").headers.get("x-aenv-node")
    root = server.node_state_dirs[node] if node else server.state_dir
    return root / "snapshots" / snapshot_id


def rand(sbx: Any) -> str:
    return str(sbx.commands.run("cat /proc/sys/kernel/random/uuid").stdout.strip())


@pytest.fixture
def sandboxes(e2b_env: dict[str, str]) -> Iterator[list[Any]]:
    """Everything a test appends here is killed afterwards, children of forks included."""
    owned: list[Any] = []
    yield owned
    for s in owned:
        try:
            s.kill()
        except Exception:
            pass


def test_filesystem_snapshot_restores_files(server: Server, sandboxes: list[Any]) -> None:
    from e2b import Sandbox

    src = Sandbox.create("base", timeout=300)
    sandboxes.append(src)
    src.files.write("/home/user/notes.txt", "kept")
    src.commands.run("mkdir -p /opt/d && echo deep > /opt/d/f && ln /opt/d/f /opt/d/hard && "
                     "rm -f /etc/debian_version && rm -rf /usr/share/doc && mkdir /usr/share/doc && "
                     "echo new > /usr/share/doc/only && truncate -s 64M /home/user/sparse", user="root")
    info = src.create_snapshot(mode="filesystem")
    row = snapshot_row(server, info.snapshot_id)
    assert row["mode"] == "filesystem"
    # the sparse 64 MiB file costs nothing in the snapshot
    assert row["sizeBytes"] < 16 << 20

    child = Sandbox.create(info.snapshot_id, timeout=300)
    sandboxes.append(child)
    assert child.sandbox_id != src.sandbox_id
    assert child.files.read("/home/user/notes.txt") == "kept"
    out = child.commands.run(
        "cat /opt/d/f; stat -c %h /opt/d/hard; test -e /etc/debian_version && echo present || echo whiteout; "
        "ls /usr/share/doc; stat -c %s /home/user/sparse", user="root").stdout.split()
    assert out == ["deep", "2", "whiteout", "only", str(64 << 20)]
    # the child's writes stay its own
    child.files.write("/home/user/notes.txt", "child")
    assert src.files.read("/home/user/notes.txt") == "kept"


@pytest.mark.skipif(CRIU.usable, reason="CRIU >= 4.2 is usable here: full snapshots are allowed")
def test_full_snapshot_refused_without_criu(server: Server, sandboxes: list[Any]) -> None:
    from e2b import Sandbox
    from e2b.exceptions import SandboxException

    sbx = Sandbox.create("base", timeout=300)
    sandboxes.append(sbx)
    with pytest.raises(SandboxException) as err:
        sbx.create_snapshot()  # the SDK's default is mode=full
    assert "filesystem" in str(err.value)
    r = api(server, "POST", f"/sandboxes/{sbx.sandbox_id}/snapshots", json={"mode": "full"})
    assert r.status_code == 409
    assert "filesystem" in r.json()["message"] and "CRIU" in r.json()["message"]
    assert sbx.is_running()


def test_fork_isolated_children_with_own_randomness(server: Server, sandboxes: list[Any]) -> None:
    from e2b import Sandbox

    src = Sandbox.create("base", timeout=300)
    sandboxes.append(src)
    src.files.write("/home/user/state.txt", "prepared")
    results = src.fork(count=4)
    children = [c for c in results if not isinstance(c, Exception)]
    sandboxes.extend(children)
    assert len(children) == 4, results
    ids = {c.sandbox_id for c in children}
    assert len(ids) == 4 and src.sandbox_id not in ids
    for c in children:
        assert c.files.read("/home/user/state.txt") == "prepared"
    children[0].files.write("/home/user/state.txt", "child0")
    children[0].files.write("/home/user/only0.txt", "x")
    for other in (src, *children[1:]):
        assert other.files.read("/home/user/state.txt") == "prepared"
        assert not other.files.exists("/home/user/only0.txt")
    src.files.write("/home/user/after.txt", "src")
    assert not children[1].files.exists("/home/user/after.txt")
    randoms = {rand(c) for c in children} | {rand(src)}
    assert len(randoms) == 5
    urandom = {c.commands.run("head -c 8 /dev/urandom | od -An -tx1").stdout for c in children}
    assert len(urandom) == 4
    # the mode is visible: the children's fork point says what was copied
    detail = api(server, "GET", f"/sandboxes/{children[0].sandbox_id}")
    assert detail.status_code == 200
    forks = [s for s in api(server, "GET", "/snapshots").json() if s["sandboxID"] == src.sandbox_id]
    assert forks == []  # internal fork points are not listed as user snapshots
    grand = children[1].fork(count=1)[0]
    assert not isinstance(grand, Exception), grand
    sandboxes.append(grand)
    assert grand.files.read("/home/user/state.txt") == "prepared"
    assert grand.sandbox_id not in ids


def test_fork_reports_mode_via_rest(server: Server, sandboxes: list[Any]) -> None:
    from e2b import Sandbox

    src = Sandbox.create("base", timeout=300)
    sandboxes.append(src)
    r = api(server, "POST", f"/sandboxes/{src.sandbox_id}/fork", json={"count": 2})
    assert r.status_code == 201, r.text
    body = r.json()
    for entry in body:
        sandboxes.append(Sandbox.connect(entry["sandbox"]["sandboxID"]))
    want = "full" if CRIU.usable else "filesystem"
    assert r.headers["X-Aenv-Fork-Mode"] == want
    assert [e["mode"] for e in body] == [want, want]
    point = snapshot_row(server, body[0]["snapshotID"])
    assert point["mode"] == want
    assert point["sandboxID"] == src.sandbox_id
    assert sorted(point["usedBy"]) == sorted(e["sandbox"]["sandboxID"] for e in body)
    # the internal fork point stays while the source's lineage points at it (rollback target), and is
    # collected once neither the source nor any child needs it
    for entry in body:
        assert api(server, "DELETE", f"/sandboxes/{entry['sandbox']['sandboxID']}").status_code == 204
    point_dir = snapshot_dir(server, body[0]["snapshotID"])
    assert point_dir.is_dir()
    src.kill()
    assert not point_dir.exists()


def test_rollback_same_id_and_token(server: Server, sandboxes: list[Any]) -> None:
    from e2b import Sandbox

    sbx = Sandbox.create("base", timeout=300, secure=True)
    sandboxes.append(sbx)
    sbx.files.write("/home/user/v.txt", "one")
    snap = api(server, "POST", f"/sandboxes/{sbx.sandbox_id}/snapshots", json={"mode": "filesystem"}).json()
    sbx.files.write("/home/user/v.txt", "two")
    sbx.files.write("/home/user/later.txt", "later")
    sbx.commands.run("rm -rf /home/user/gone; sleep 600", background=True)
    r = api(server, "POST", f"/sandboxes/{sbx.sandbox_id}/rollback", json={"snapshotID": snap["snapshotID"]})
    assert r.status_code == 200, r.text
    assert r.json()["sandboxID"] == sbx.sandbox_id
    # the same SDK object (same ID, same envd access token) keeps working
    assert sbx.files.read("/home/user/v.txt") == "one"
    assert not sbx.files.exists("/home/user/later.txt")
    assert "sleep 600" not in sbx.commands.run("ps -eo args").stdout  # processes restart fresh
    again = Sandbox.connect(sbx.sandbox_id)
    assert again.files.read("/home/user/v.txt") == "one"
    # write after rollback, snapshot again, roll back twice: still the same sandbox
    sbx.files.write("/home/user/v.txt", "three")
    snap2 = api(server, "POST", f"/sandboxes/{sbx.sandbox_id}/snapshots", json={"mode": "filesystem"}).json()
    assert snapshot_row(server, snap2["snapshotID"])["parentID"] == snap["snapshotID"]
    sbx.files.write("/home/user/v.txt", "four")
    assert api(server, "POST", f"/sandboxes/{sbx.sandbox_id}/rollback",
               json={"snapshotID": snap2["snapshotID"]}).status_code == 200
    assert sbx.files.read("/home/user/v.txt") == "three"
    assert api(server, "POST", f"/sandboxes/{sbx.sandbox_id}/rollback",
               json={"snapshotID": snap["snapshotID"]}).status_code == 200
    assert sbx.files.read("/home/user/v.txt") == "one"
    # only back along the lineage: snap2 is now a descendant of the head, not an ancestor
    assert api(server, "POST", f"/sandboxes/{sbx.sandbox_id}/rollback",
               json={"snapshotID": snap2["snapshotID"]}).status_code == 409


def test_chained_snapshots_store_only_the_delta(server: Server, sandboxes: list[Any]) -> None:
    from e2b import Sandbox

    a = Sandbox.create("base", timeout=300)
    sandboxes.append(a)
    a.commands.run("head -c 20000000 /dev/urandom > /home/user/big")
    s1 = snapshot_row(server, a.create_snapshot(mode="filesystem").snapshot_id)
    assert s1["sizeBytes"] >= 20_000_000
    b = Sandbox.create(s1["snapshotID"], timeout=300)
    sandboxes.append(b)
    b.commands.run("head -c 1000000 /dev/urandom > /home/user/small")
    s2 = snapshot_row(server, b.create_snapshot(mode="filesystem").snapshot_id)
    assert s2["parentID"] == s1["snapshotID"]
    assert s2["sizeBytes"] < 5_000_000  # the 20 MB stay in s1's layer
    c = Sandbox.create(s2["snapshotID"], timeout=300)
    sandboxes.append(c)
    assert c.commands.run("stat -c %s /home/user/big /home/user/small").stdout.split() == ["20000000", "1000000"]
    # once no sandbox uses them: s1 is still a layer of s2, so it cannot go while s2 exists
    b.kill()
    c.kill()
    r = api(server, "DELETE", f"/templates/{s1['snapshotID']}")
    assert r.status_code == 409 and s2["snapshotID"] in r.json()["message"]
    assert api(server, "DELETE", f"/templates/{s2['snapshotID']}").status_code == 204
    assert api(server, "DELETE", f"/templates/{s1['snapshotID']}").status_code == 204


def test_delete_snapshot_in_use(server: Server, sandboxes: list[Any]) -> None:
    from e2b import Sandbox

    src = Sandbox.create("base", timeout=300)
    sandboxes.append(src)
    snap = src.create_snapshot(mode="filesystem").snapshot_id
    user = Sandbox.create(snap, timeout=300)
    sandboxes.append(user)
    directory = snapshot_dir(server, snap)
    assert (directory / "upper").is_dir()
    r = api(server, "DELETE", f"/templates/{snap}")
    assert r.status_code == 409 and user.sandbox_id in r.json()["message"]
    user.kill()
    r = api(server, "DELETE", f"/templates/{snap}")
    assert r.status_code == 204, r.text
    assert not directory.exists()
    assert api(server, "GET", f"/snapshots/{snap}").status_code == 404


@pytest.mark.criu
@pytest.mark.skipif(not CRIU.usable, reason=f"needs CRIU >= 4.2: {CRIU.reason}")
def test_full_snapshot_keeps_processes(server: Server, sandboxes: list[Any]) -> None:
    from e2b import Sandbox

    sbx = Sandbox.create("base", timeout=300, allow_internet_access=False)
    sandboxes.append(sbx)
    sbx.commands.run("sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/c; sleep 0.1; done'", background=True)
    info = sbx.create_snapshot()
    assert snapshot_row(server, info.snapshot_id)["mode"] == "full"
    child = Sandbox.create(info.snapshot_id, timeout=300)
    sandboxes.append(child)
    assert "while" in child.commands.run("ps -eo args").stdout


def test_pause_restart_resume_keeps_data(tmp_path: Path, e2b_env: dict[str, str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A paused sandbox (one started from a snapshot, so its overlay has a snapshot layer) survives a
    server restart on the same state dir; resume brings its files back and it can snapshot again."""
    from e2b import Sandbox

    srv = start_server(tmp_path, "ns", extra_env={"AENV_POOL_SIZE": "0", **KEEP_SANDBOXES})
    try:
        for k in ("E2B_API_URL", "E2B_SANDBOX_URL"):
            monkeypatch.setenv(k, srv.url)
        base = Sandbox.create("base", timeout=600)
        base.files.write("/home/user/layer.txt", "from the snapshot")
        snap = base.create_snapshot(mode="filesystem").snapshot_id
        sbx = Sandbox.create(snap, timeout=600)
        sbx.files.write("/home/user/own.txt", "own")
        sbx.pause()
        # a paused sandbox can be snapshotted and stays paused
        r = api(srv, "POST", f"/sandboxes/{sbx.sandbox_id}/snapshots", json={"mode": "filesystem"})
        assert r.status_code == 201, r.text
        assert api(srv, "GET", f"/sandboxes/{sbx.sandbox_id}").json()["state"] == "paused"
        port = int(srv.url.rsplit(":", 1)[1])
        stop_server(srv)
        srv = start_server(tmp_path, "ns", extra_env={"AENV_POOL_SIZE": "0", **KEEP_SANDBOXES}, port=port)
        again = Sandbox.connect(sbx.sandbox_id, timeout=600)
        assert again.files.read("/home/user/layer.txt") == "from the snapshot"
        assert again.files.read("/home/user/own.txt") == "own"
        again.files.write("/home/user/own.txt", "changed")
        snap2 = again.create_snapshot(mode="filesystem").snapshot_id
        again.files.write("/home/user/own.txt", "later")
        assert api(srv, "POST", f"/sandboxes/{again.sandbox_id}/rollback",
                   json={"snapshotID": snap2}).status_code == 200
        assert again.files.read("/home/user/own.txt") == "changed"
        assert again.files.read("/home/user/layer.txt") == "from the snapshot"
    finally:
        try:
            for s in api(srv, "GET", "/v2/sandboxes").json():
                api(srv, "DELETE", f"/sandboxes/{s['sandboxID']}")
        except Exception:
            pass
        stop_server(srv)


def test_deep_chain_is_compacted(tmp_path: Path, e2b_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """With a depth limit of 2, the third snapshot in a chain merges its layers: sandboxes from it see
    every change (including deletions), and the layers below it can then be deleted."""
    from e2b import Sandbox

    srv = start_server(tmp_path, "ns", extra_env={"AENV_POOL_SIZE": "0", "AENV_NS_SNAPSHOT_MAX_DEPTH": "2"})
    try:
        for k in ("E2B_API_URL", "E2B_SANDBOX_URL"):
            monkeypatch.setenv(k, srv.url)
        cur = Sandbox.create("base", timeout=300)
        snaps: list[str] = []
        for i in range(3):
            cur.files.write(f"/home/user/f{i}", str(i))
            if i == 1:
                cur.commands.run("rm /home/user/f0 && rm -rf /etc/apt", user="root")
            snaps.append(cur.create_snapshot(mode="filesystem").snapshot_id)
            cur.kill()
            cur = Sandbox.create(snaps[-1], timeout=300)
        out = cur.commands.run("ls /home/user; test -e /etc/apt && echo apt || echo no-apt").stdout.split()
        assert out == ["f1", "f2", "no-apt"]
        cur.kill()
        last = Sandbox.create(snaps[2], timeout=300)
        # snaps[2] is self-contained: the older layers can go while a sandbox runs from it
        for s in (snaps[1], snaps[0]):
            r = api(srv, "DELETE", f"/templates/{s}")
            assert r.status_code == 204, r.text
        assert last.commands.run("cat /home/user/f1 /home/user/f2").stdout == "12"
        assert not last.files.exists("/home/user/f0")
    finally:
        try:
            for s in api(srv, "GET", "/v2/sandboxes").json():
                api(srv, "DELETE", f"/sandboxes/{s['sandboxID']}")
        except Exception:
            pass
        stop_server(srv)

"""Crash safety of snapshot publishing: SIGKILL the server in the middle of uploading a snapshot to S3.

The fault point ``publish.layer`` fires after a layer is packed and before it is uploaded. Armed on its
third hit, the first snapshot (one layer) publishes whole and the second (an incremental snapshot:
its own ``upper`` + the first's as ``stack/0``) dies after uploading one of its two layers. Then:

* the repository shows the first snapshot only: no manifest of the half-uploaded one;
* a restarted server publishes it again on its own, and cleans the scratch file the crash left;
* a third server (fresh state dir, same bucket) starts a sandbox from it with every file;
* the sandboxes of the crashed server are intact, nothing leaked on the host, and deleting both
  snapshots leaves the bucket prefix empty.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import Sandbox

from aenv.testing.server import Server, start_server, stop_server
from tests.fixtures.seaweedfs import SeaweedFS, seaweedfs, unique_prefix  # noqa: F401
from tests.reliability.helpers import ServerFactory, api, leaks, sdk_kwargs, wait_dead


@pytest.fixture
def s3_servers(tmp_path: Path, runtime_name: str, seaweedfs: SeaweedFS) -> Iterator[tuple[ServerFactory, str]]:  # noqa: F811
    if runtime_name != "ns":
        pytest.skip("ns runtime only (vm snapshots take minutes under TCG)")
    prefix = unique_prefix("crash")
    factory = ServerFactory(tmp_path, runtime_name, {**seaweedfs.server_env(prefix), "AENV_POOL_SIZE": "0"})
    try:
        yield factory, prefix
    finally:
        factory.close()


def _published(server: Server, snapshot_id: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    with api(server) as c:
        while time.monotonic() < deadline:
            r = c.get(f"/snapshots/{snapshot_id}")
            assert r.status_code == 200, r.text
            if r.json()["published"]:
                return
            time.sleep(0.1)
    raise AssertionError(f"snapshot {snapshot_id} never published:\n{server.log_tail()}")


def _snapshot(server: Server, sandbox_id: str) -> str:
    with api(server) as c:
        r = c.post(f"/sandboxes/{sandbox_id}/snapshots", json={"mode": "filesystem"})
    assert r.status_code == 201, r.text
    return str(r.json()["snapshotID"])


def test_crash_mid_upload_then_restart_publishes(
    s3_servers: tuple[ServerFactory, str], seaweedfs: SeaweedFS, tmp_path: Path  # noqa: F811
) -> None:
    servers, prefix = s3_servers
    first = servers.start(faults="publish.layer:3")
    conn = sdk_kwargs(first)
    src = Sandbox.create("base", timeout=600, **conn)
    src.files.write("/home/user/one.txt", "first")
    s1 = _snapshot(first, src.sandbox_id)
    _published(first, s1)
    kid = Sandbox.create(s1, timeout=600, **conn)
    kid.files.write("/home/user/two.txt", "second")
    # the response may or may not beat the crash: the snapshot row is committed before publishing
    with api(first) as c:
        try:
            c.post(f"/sandboxes/{kid.sandbox_id}/snapshots", json={"mode": "filesystem"})
        except Exception:
            pass
    assert wait_dead(first) == -9, f"server did not die:\n{first.log_tail()}"
    assert "fault point publish.layer fired" in first.log_tail(200)

    keys = seaweedfs.keys(prefix)
    assert [k for k in keys if k.startswith("manifests/")] == [f"manifests/{s1}.json"], keys
    scratch = servers.state_dir / "snapshot-scratch"
    assert [p.name for p in scratch.iterdir() if p.name.startswith("layer-")], "the crash left no packed layer?"

    second = servers.start()
    with api(second) as c:
        snaps = [s["snapshotID"] for s in c.get("/snapshots").json()]
    assert s1 in snaps and len(snaps) == 2, snaps
    s2 = next(s for s in snaps if s != s1)
    _published(second, s2)
    assert "re-publishing 1 snapshot" in second.log_tail(200)
    assert f"manifests/{s2}.json" in seaweedfs.keys(prefix)
    assert not list(scratch.iterdir()), "scratch files of the crashed publish were not cleaned"

    # the re-published snapshot is whole: a server that never saw it starts from it
    (tmp_path / "other").mkdir()
    other = start_server(tmp_path / "other", "ns", {**servers.base_env, "AENV_FAULTS": ""})
    try:
        far = Sandbox.create(s2, timeout=120, **sdk_kwargs(other))
        assert far.files.read("/home/user/one.txt") == "first"
        assert far.files.read("/home/user/two.txt") == "second"
        far.kill()
    finally:
        stop_server(other)

    # the crashed server's sandboxes survived; nothing on the host is unaccounted for
    conn = sdk_kwargs(second)
    for sbx, path, content in ((src, "/home/user/one.txt", "first"), (kid, "/home/user/two.txt", "second")):
        assert Sandbox.connect(sbx.sandbox_id, **conn).files.read(path) == content
    live = {src.sandbox_id, kid.sandbox_id}
    assert not leaks(servers.state_dir, (), live)
    for sid in live:
        assert Sandbox.kill(sid, **conn)
    with api(second) as c:
        for snap in (s2, s1):
            assert c.delete(f"/templates/{snap}").status_code == 204
    assert seaweedfs.keys(prefix) == [], "layers or manifests leaked in the bucket"
    assert not leaks(servers.state_dir, live, ())
    assert not os.listdir(servers.state_dir / "snapshots")

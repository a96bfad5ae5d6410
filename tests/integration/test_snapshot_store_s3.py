"""Snapshots through an S3 snapshot store (SeaweedFS), between two servers, with the unmodified e2b SDK.

Server A publishes to ``s3://bucket/<prefix>``; server B, with a fresh state dir and the same bucket,
starts a sandbox from the snapshot ID it has never seen (looked up in the repository, downloaded,
verified, registered). Deleting the snapshots on the servers empties the prefix: nothing leaks.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from aenv.testing.server import API_KEY, Server, start_server, stop_server
from tests.fixtures.seaweedfs import SeaweedFS, seaweedfs, unique_prefix  # noqa: F401

pytestmark = pytest.mark.skipif(os.environ.get("AENV_TEST_RUNTIME", "ns") != "ns", reason="ns runtime suite")

HEADERS = {"X-API-KEY": API_KEY}


def conn(server: Server) -> dict[str, str]:
    return {"api_url": server.url, "sandbox_url": server.url, "api_key": API_KEY}


def api(server: Server, method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(method, server.url + path, headers=HEADERS, trust_env=False, timeout=120, **kw)


def wait_published(server: Server, snapshot_id: str, timeout: float = 120) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        r = api(server, "GET", f"/snapshots/{snapshot_id}")
        assert r.status_code == 200, r.text
        if r.json()["published"]:
            return time.monotonic() - t0
        time.sleep(0.1)
    raise AssertionError(f"snapshot {snapshot_id} not published:\n{server.log_tail()}")


def test_snapshot_travels_between_servers_through_s3(tmp_path: Path, seaweedfs: SeaweedFS) -> None:  # noqa: F811
    if os.geteuid() != 0:
        pytest.skip("the ns runtime needs root")
    from e2b import Sandbox

    prefix = unique_prefix("sdk")
    env = {**seaweedfs.server_env(prefix), "AENV_POOL_SIZE": "0"}
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    a = start_server(tmp_path / "a", "ns", env)
    b: Server | None = None
    try:
        src = Sandbox.create("base", timeout=300, **conn(a))
        src.files.write("/home/user/notes.txt", "travelled")
        src.commands.run("mkdir -p /opt/d && echo deep > /opt/d/f && ln /opt/d/f /opt/d/hard && "
                         "rm -f /etc/debian_version && head -c 4M /dev/urandom > /opt/blob && "
                         "sha256sum /opt/blob > /opt/blob.sum", user="root")
        first = src.create_snapshot(mode="filesystem").snapshot_id
        kid = Sandbox.create(first, timeout=300, **conn(a))
        kid.files.write("/home/user/second.txt", "incremental")
        second = kid.create_snapshot(mode="filesystem").snapshot_id  # an incremental layer on the first
        waited = max(wait_published(a, first), wait_published(a, second))
        times = re.findall(r"snapshot=\w+ published in ([0-9.]+)s", a.log_path.read_text())
        print(f"\npublish: waited {waited:.2f}s after the second snapshot; publish times {times}")
        keys = seaweedfs.keys(prefix)
        # two manifests, two layers: the first's upper is also the second's stack/0, stored once
        assert sorted(k.split("/")[0] for k in keys) == ["layers", "layers", "manifests", "manifests"], keys
        assert {f"manifests/{first}.json", f"manifests/{second}.json"} <= set(keys), keys

        b = start_server(tmp_path / "b", "ns", env)
        assert api(b, "GET", f"/snapshots/{second}").status_code == 404  # B has never heard of it
        t0 = time.monotonic()
        child = Sandbox.create(second, timeout=300, **conn(b))
        print(f"fetch + start on server B: {time.monotonic() - t0:.2f}s")
        assert child.files.read("/home/user/notes.txt") == "travelled"
        assert child.files.read("/home/user/second.txt") == "incremental"
        out = child.commands.run(
            "cat /opt/d/f; stat -c %h /opt/d/hard; test -e /etc/debian_version && echo present || echo whiteout; "
            "sha256sum -c --quiet /opt/blob.sum && echo intact", user="root").stdout.split()
        assert out == ["deep", "2", "whiteout", "intact"]
        row = api(b, "GET", f"/snapshots/{second}").json()
        assert row["published"] is True
        child.kill()

        # Delete everywhere: B's delete removes the repository copy, A's the rest; nothing is left.
        assert api(b, "DELETE", f"/templates/{second}").status_code == 204
        assert f"manifests/{second}.json" not in seaweedfs.keys(prefix)
        src.kill()
        kid.kill()
        for snap in (second, first):
            r = api(a, "DELETE", f"/templates/{snap}")
            assert r.status_code == 204, r.text
        assert seaweedfs.keys(prefix) == []
    finally:
        for srv in (a, b):
            if srv is not None:
                stop_server(srv)

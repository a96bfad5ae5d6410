"""A team's secrets behind a gateway in cluster mode: two ``aenv serve --cluster-redis`` nodes (ns) and a
gateway on the same real redis-server, the HTTPS echo hosts of ``test_header_rules.py`` as the outside.

A secret made through the gateway with the E2B SDK is injected by the egress proxy of a sandbox on
EITHER node (placement forced by the idempotency key), and a node's later update reaches both; a list
through the gateway shows it once; get, update and delete go through; another team's key gets the
same 404 as an unknown ID. The value is in no answer, no node's or the gateway's log, and no node's
SQLite (the cluster's Redis holds it). Before secrets were shared, the sandbox on the node that did
not take the create got no header (and its create was a 400: its node had no such secret)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from aenv.cluster.redis_proc import RedisProc
from aenv.directory import keys
from aenv.gateway.placement import by_key
from aenv.testing.server import API_KEY
from tests.fixtures.directory_cluster import KEY, DirectoryCluster, running
from tests.fixtures.echohosts import EchoHosts, hosts  # noqa: F401
from tests.fixtures.plugin import PushedImages
from tests.fixtures.redis import redis_server  # noqa: F401

pytestmark = pytest.mark.timeout(900)

SECRET = "aenv-gw-secret-" + os.urandom(8).hex()
ROTATED = SECRET + "-v2"
OTHER = {"X-API-KEY": "e2b_" + "5" * 40}  # another team's key


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisProc,  # noqa: F811
            pushed_images: PushedImages, hosts: EchoHosts) -> Iterator[DirectoryCluster]:  # noqa: F811  # fmt: skip
    env = {"AENV_SANDBOX_DNS": hosts.dns, "AENV_EGRESS_EXTRA_CA": str(hosts.ca),
           "AENV_API_KEYS": f"{API_KEY},{OTHER['X-API-KEY']}"}  # fmt: skip
    with running(DirectoryCluster(tmp_path_factory.mktemp("gwsec"), redis_server.url, env), redis_server,
                 pushed_images) as c:  # fmt: skip
        yield c


def _create_on(c: DirectoryCluster, node_id: str, rules: dict[str, Any]) -> str:
    """A sandbox made through the gateway on ``node_id``: an idempotency key that maps there."""
    key = next(k for k in (f"gwsec-{i}" for i in range(1000)) if by_key([("n1", 0.0), ("n2", 0.0)], k) == node_id)
    made = httpx.post(c.gw + "/sandboxes", json={"templateID": "base", "timeout": 600, "network": {"rules": rules}},
                      headers={**KEY, "Idempotency-Key": key}, trust_env=False, timeout=300)  # fmt: skip
    assert made.status_code == 201, made.text
    sid = str(made.json()["sandboxID"])
    assert c.r.hget(keys.sandbox_key(sid), "node") == node_id
    return sid


def _echoed(sid: str) -> dict[str, list[str]]:
    from e2b import Sandbox

    out = Sandbox.connect(sid).commands.run("curl -sS --max-time 10 https://echo.test/headers", timeout=60).stdout
    return dict(json.loads(out)["headers"])


def test_one_secret_for_every_node(cluster: DirectoryCluster) -> None:
    from e2b import Secret

    gw = cluster.gw
    info = Secret.create("echo-token", SECRET)  # the unmodified SDK, through the gateway
    sid_ = info.secret_id
    assert cluster.r.exists(f"aenv:secret:{sid_}")  # in the cluster's Redis, not one node's database
    rules = {"echo.test": [{"transform": {"headers": {"X-Token": Secret.fill("echo-token")}}}]}
    on = {node: _create_on(cluster, node, rules) for node in ("n1", "n2")}
    for sid in on.values():
        assert _echoed(sid)["X-Token"] == [SECRET]

    answers = [httpx.get(f"{gw}/secrets", headers=KEY, trust_env=False)]
    assert [s["secretID"] for s in answers[0].json()] == [sid_]  # once, not once per node
    for node in (0, 1):  # every node lists it, and reads it by name
        got = httpx.get(f"{cluster.url(node)}/secrets/echo-token", headers=KEY, trust_env=False)
        assert got.status_code == 200 and got.json()["secretID"] == sid_
        answers.append(got)
    upd = httpx.post(f"{gw}/secrets/{sid_}", json={"value": ROTATED, "metadata": {"k": "v"}}, headers=KEY,
                     trust_env=False)  # fmt: skip
    assert upd.status_code == 200 and upd.json()["currentVersion"] == 2, upd.text
    answers += [upd, httpx.get(f"{gw}/secrets/{sid_}", headers=KEY, trust_env=False)]
    assert answers[-1].json()["metadata"] == {"k": "v"}
    for sid in on.values():  # the next request on either node has the new value
        assert _echoed(sid)["X-Token"] == [ROTATED]

    # another team: the same answers as for an unknown secret; its list is empty; its rules cannot name it
    unknown = httpx.get(f"{gw}/secrets/sec_{'0' * 24}", headers=OTHER, trust_env=False)
    assert unknown.status_code == 404
    for method, body in (("GET", None), ("POST", {"value": "stolen"}), ("DELETE", None)):
        got = httpx.request(method, f"{gw}/secrets/{sid_}", json=body, headers=OTHER, trust_env=False)
        assert got.status_code == 404 and got.json()["message"] == f"secret '{sid_}' not found", got.text
    assert httpx.get(f"{gw}/secrets", headers=OTHER, trust_env=False).json() == []
    made = httpx.post(gw + "/sandboxes", json={"templateID": "base", "network": {"rules": rules}}, headers=OTHER,
                      trust_env=False, timeout=300)  # fmt: skip
    assert made.status_code == 400 and "echo-token" in made.text, made.text

    assert httpx.delete(f"{gw}/secrets/{sid_}", headers=KEY, trust_env=False).status_code == 204
    assert httpx.get(f"{gw}/secrets/echo-token", headers=KEY, trust_env=False).status_code == 404
    assert httpx.get(f"{gw}/secrets", headers=KEY, trust_env=False).json() == []
    from e2b import Sandbox

    gone = Sandbox.connect(on["n2"]).commands.run("curl -s -o /dev/null -w '%{http_code}' --max-time 10 "
                                                  "https://echo.test/headers", timeout=60).stdout  # fmt: skip
    assert gone.strip() == "502"  # a deleted secret: the request is not sent without it

    for text in (a.text for a in answers):
        assert SECRET not in text and ROTATED not in text
    logs = [Path(n.log_path) for n in cluster.nodes if n is not None]
    assert cluster.gateway is not None
    logs.append(Path(cluster.gateway.log_path))
    for log in logs:
        text = log.read_text(errors="replace")
        assert SECRET not in text and ROTATED not in text, log
    for node in cluster.nodes:
        assert node is not None
        for db in node.state_dir.glob("aenv.db*"):
            assert SECRET.encode() not in db.read_bytes() and ROTATED.encode() not in db.read_bytes(), db

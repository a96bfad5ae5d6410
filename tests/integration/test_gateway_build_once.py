"""Build once, run anywhere: ``aenv gateway`` on the cluster directory (Redis) in front of ``aenv serve``
nodes (ns, cluster mode) that share one ``file://`` snapshot store, driven by the unmodified E2B SDK
pointed at the gateway.

A template built through the gateway runs its steps on one node only (the others do not know the
build); its result is in the shared store, with its whole tree as a lazy artifact (cluster mode turns
lazy images on), so a sandbox of it starts on every node, and on a fourth node that joins after the
build: the gateway was never told of it, it learns it from the directory. Every node runs the very
same bytes (a step that writes random bytes reads the same everywhere), and a node that did not build
it fetched no more chunks than its sandboxes read (aenv-lazyd's counters). Deleting it through the
gateway takes it off every node and out of the store, its lazy artifact too.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from aenv.cluster.redis_proc import RedisProc
from aenv.images.lazy.service import lazy_name
from aenv.testing.gateway import NodeCluster, sdk_env, start_gateway, wait_for
from aenv.testing.server import API_KEY
from tests.fixtures.redis import redis_server  # noqa: F401

pytestmark = pytest.mark.timeout(900)

KEY = {"X-API-KEY": API_KEY}
NODES = 4  # the fourth joins after the build


class Cluster(NodeCluster):
    def __init__(self, tmp: Path, redis_url: str) -> None:
        self.store = tmp / "store"
        super().__init__(tmp, NODES, {"AENV_API_KEYS": API_KEY, "AENV_POOL_SIZE": "0", "AENV_CLUSTER_REDIS": redis_url,
                                      "AENV_SNAPSHOT_STORE": f"file://{self.store}",
                                      "AENV_TEMPLATE_RECHECK_S": "0"})  # fmt: skip

    def env_of(self, i: int) -> dict[str, str]:
        return {**self.node_env, "AENV_CLUSTER_NODE_ID": f"n{i + 1}"}

    def up_in_gateway(self, count: int) -> bool:
        nodes = httpx.get(self.gw + "/nodes", headers=KEY, trust_env=False).json()
        up = [n for n in nodes if n["state"] == "up" and n.get("templateStore") == f"file://{self.store}"]
        return len(up) == count

    def lazy_stats(self, i: int, name: str) -> dict[str, object] | None:
        got = httpx.get(self.url(i) + "/aenv/cache", headers=KEY, trust_env=False).json()
        return next((img for img in got["lazy"]["images"] if img["name"] == name), None)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisProc) -> Iterator[Cluster]:  # noqa: F811
    if os.geteuid() != 0:
        pytest.skip("the ns runtime needs root")
    import redis

    with redis.Redis.from_url(redis_server.url) as r:
        r.flushall()
    c = Cluster(tmp_path_factory.mktemp("build-once"), redis_server.url)
    try:
        for i in range(NODES - 1):
            c.start_node(i)
        # no node list: the gateway knows the nodes from the directory alone
        c.gateway = start_gateway(c.tmp, [], {"AENV_API_KEYS": API_KEY, "AENV_GATEWAY_REDIS": redis_server.url})
        wait_for(lambda: c.up_in_gateway(NODES - 1))
        with sdk_env(c.gw):
            yield c
    finally:
        c.close()


def _run_on(cluster: Cluster, i: int, ref: str, cmd: str = "cat /opt/b /srv/f.txt") -> str:
    """A sandbox of ``ref`` created on node ``i`` itself, used through the gateway: ``cmd``'s output."""
    from e2b import Sandbox

    made = httpx.post(cluster.url(i) + "/v2/sandboxes", json={"templateID": ref}, headers=KEY, trust_env=False,
                      timeout=300)  # fmt: skip
    assert made.status_code == 201, (i, made.text)
    sbx = Sandbox.connect(made.json()["sandboxID"])
    try:
        return str(sbx.commands.run(cmd).stdout)
    finally:
        sbx.kill()


def test_a_build_runs_once_and_starts_on_every_node_and_a_later_one(cluster: Cluster, tmp_path: Path) -> None:
    from e2b import Sandbox, Template

    (tmp_path / "f.txt").write_text("copied once\n")
    template = (Template(file_context_path=str(tmp_path)).from_template("base").copy("f.txt", "/srv/f.txt")
                .run_cmd("head -c 8 /dev/urandom | od -An -tx1 | tr -d ' \\n' > /opt/b; echo >> /opt/b"))  # fmt: skip
    name = f"once-{secrets.token_hex(3)}"
    info = Template.build(template, name, cpu_count=1, memory_mb=512)
    assert Template.exists(name)

    # it ran once: one node knows the build, the others never heard of it
    status = f"/templates/{info.template_id}/builds/{info.build_id}/status"
    codes = [httpx.get(cluster.url(i) + status, headers=KEY, trust_env=False).status_code for i in range(NODES - 1)]
    assert sorted(codes) == [200, 404, 404], codes
    builder = codes.index(200)
    assert (cluster.store / "templates" / f"{info.template_id}.json").is_file()

    # its whole tree is in the store as a lazy artifact
    manifest = json.loads((cluster.store / "templates" / f"{info.template_id}.json").read_bytes())
    lazy = manifest["lazy"]
    assert lazy["chunks"] > 0 and (cluster.store / "lazy" / lazy["digest"].split(":")[1] / "index.json").is_file()

    # a tag added through the gateway after the build reaches the store: the node that joins later knows it
    tagged = httpx.post(cluster.gw + "/templates/tags", json={"target": name, "tags": ["v2"]}, headers=KEY,
                        trust_env=False, timeout=60)  # fmt: skip
    assert tagged.status_code == 201, tagged.text
    aliases = lambda: {r["alias"] for r in json.loads(  # noqa: E731
        (cluster.store / "templates" / f"{info.template_id}.json").read_bytes())["rows"]}
    assert f"{name}:v2" in aliases()

    # every node starts it (by name, ID or the new tag), the fourth one, joining after the build, too: the same bytes
    cluster.start_node(NODES - 1)
    wait_for(lambda: cluster.up_in_gateway(NODES))
    nodes = {n["nodeID"] for n in httpx.get(cluster.gw + "/nodes", headers=KEY, trust_env=False).json()}
    assert nodes == {f"n{i + 1}" for i in range(NODES)}
    outputs = {i: _run_on(cluster, i, f"{name}:v2" if i == NODES - 1 else name if i % 2 else info.template_id)
               for i in range(NODES)}
    assert len(set(outputs.values())) == 1 and next(iter(outputs.values())).endswith("copied once\n"), outputs

    # the nodes that did not build it read it lazily: only the chunks their sandboxes touched were fetched
    for i in range(NODES):
        st = cluster.lazy_stats(i, lazy_name(lazy["digest"]))
        if i == builder:
            assert st is None  # it runs its own layers
            continue
        assert st is not None, i
        assert st["chunks_fetched"] == st["chunks_touched"] and st["max_fetches_per_chunk"] == 1, (i, st)
        assert 0 < int(st["fetched"]) < int(st["stored"]) == lazy["stored"], (i, st)  # type: ignore[call-overload]
        print(f"node n{i + 1}: fetched {st['fetched']} of {st['stored']} bytes stored, {st['chunks_fetched']} chunks "
              f"of {lazy['chunks']}")
    for i in range(NODES):  # same ID and name on every node
        got = httpx.get(f"{cluster.url(i)}/templates/aliases/{name}", headers=KEY, trust_env=False)
        assert got.status_code == 200 and got.json()["templateID"] == info.template_id, (i, got.text)
    with Sandbox.create(name) as sbx:  # and through the gateway
        assert sbx.commands.run("cat /opt/b").stdout == outputs[builder].splitlines(keepends=True)[0]
    listed = httpx.get(cluster.gw + "/templates", headers=KEY, trust_env=False).json()
    assert [t["templateID"] for t in listed].count(info.template_id) == 1
    untagged = httpx.request("DELETE", cluster.gw + "/templates/tags", json={"name": name, "tags": ["v2"]},
                             headers=KEY, trust_env=False, timeout=60)  # fmt: skip
    assert untagged.status_code == 204, untagged.text
    assert f"{name}:v2" not in aliases() and name in {a.partition(":")[0] for a in aliases()}

    # deleting it through the gateway: gone from every node and from the store
    gone = httpx.delete(f"{cluster.gw}/templates/{info.template_id}", headers=KEY, trust_env=False, timeout=120)
    assert gone.status_code == 204, gone.text
    for i in range(NODES):
        assert httpx.get(f"{cluster.url(i)}/templates/{info.template_id}", headers=KEY,
                         trust_env=False).status_code == 404  # fmt: skip
    assert not list((cluster.store / "templates").glob("*.json"))
    assert not list((cluster.store / "template-names").glob("*.json"))
    assert not list((cluster.store / "manifests").glob("*.json"))  # its snapshot too
    assert not list((cluster.store / "lazy").glob("*/index.json"))  # and its lazy artifact
    made = httpx.post(cluster.gw + "/v2/sandboxes", json={"templateID": name}, headers=KEY, trust_env=False)
    assert made.status_code == 404, made.text
    assert not Template.exists(name)


def test_a_rebuild_on_one_node_reaches_the_nodes_that_held_the_previous_build(cluster: Cluster) -> None:
    """A rebuild runs on one node; a node that held the previous build asks the store at its next create
    (``template_recheck_s``: 0 here) and starts the new build, as every node does."""
    from e2b import Template

    if not cluster.up_in_gateway(NODES):  # run alone: the fourth node is not started yet
        cluster.start_node(NODES - 1)
        wait_for(lambda: cluster.up_in_gateway(NODES))
    name = f"rebuilt-{secrets.token_hex(3)}"

    def build(word: str) -> str:
        return str(Template.build(Template().from_template("base").run_cmd(f"echo {word} > /opt/w"), name,
                                  cpu_count=1, memory_mb=512).build_id)  # fmt: skip

    first = build("first")
    assert {_run_on(cluster, i, name, "cat /opt/w") for i in range(NODES)} == {"first\n"}
    second = build("second")
    assert second != first
    assert {i: _run_on(cluster, i, name, "cat /opt/w") for i in range(NODES)} == dict.fromkeys(range(NODES), "second\n")
    gone = httpx.delete(f"{cluster.gw}/templates/{name}", headers=KEY, trust_env=False, timeout=120)
    assert gone.status_code == 204, gone.text

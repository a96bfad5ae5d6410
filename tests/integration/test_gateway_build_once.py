"""Build once, run anywhere: ``aenv gateway`` in front of three ``aenv serve`` nodes (ns) that share one
``file://`` snapshot store, driven by the unmodified E2B SDK pointed at the gateway.

A template built through the gateway runs its steps on one node only (the others do not know the
build); its result is in the shared store, so a sandbox of it starts on every node, and on a fourth
node started after the build; every node runs the very same bytes (a step that writes random bytes
reads the same everywhere). Deleting it through the gateway takes it off every node and out of the
store.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from aenv.testing.gateway import NodeCluster, sdk_env, start_gateway, wait_for
from aenv.testing.server import API_KEY

pytestmark = pytest.mark.timeout(900)

KEY = {"X-API-KEY": API_KEY}
NODES = 4  # the fourth starts after the build


class Cluster(NodeCluster):
    def __init__(self, tmp: Path) -> None:
        self.store = tmp / "store"
        super().__init__(tmp, NODES, {"AENV_API_KEYS": API_KEY, "AENV_POOL_SIZE": "0",
                                      "AENV_SNAPSHOT_STORE": f"file://{self.store}"})  # fmt: skip

    def up_in_gateway(self, count: int) -> bool:
        nodes = httpx.get(self.gw + "/nodes", headers=KEY, trust_env=False).json()
        up = [n for n in nodes if n["state"] == "up" and n.get("templateStore") == f"file://{self.store}"]
        return len(up) == count


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if os.geteuid() != 0:
        pytest.skip("the ns runtime needs root")
    c = Cluster(tmp_path_factory.mktemp("build-once"))
    try:
        for i in range(NODES - 1):
            c.start_node(i)
        c.gateway = start_gateway(c.tmp, [c.url(i) for i in range(NODES)], {"AENV_API_KEYS": API_KEY})
        wait_for(lambda: c.up_in_gateway(NODES - 1))
        with sdk_env(c.gw):
            yield c
    finally:
        c.close()


def _run_on(cluster: Cluster, i: int, ref: str) -> str:
    """A sandbox of ``ref`` created on node ``i`` itself, used through the gateway: its output."""
    from e2b import Sandbox

    made = httpx.post(cluster.url(i) + "/v2/sandboxes", json={"templateID": ref}, headers=KEY, trust_env=False,
                      timeout=300)  # fmt: skip
    assert made.status_code == 201, (i, made.text)
    sbx = Sandbox.connect(made.json()["sandboxID"])
    try:
        return str(sbx.commands.run("cat /opt/b /srv/f.txt").stdout)
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

    # every node starts it (by name or by ID), the fourth one started after the build too: the same bytes
    cluster.start_node(NODES - 1)
    wait_for(lambda: cluster.up_in_gateway(NODES))
    outputs = {i: _run_on(cluster, i, name if i % 2 else info.template_id) for i in range(NODES)}
    assert len(set(outputs.values())) == 1 and next(iter(outputs.values())).endswith("copied once\n"), outputs
    for i in range(NODES):  # same ID and name on every node
        got = httpx.get(f"{cluster.url(i)}/templates/aliases/{name}", headers=KEY, trust_env=False)
        assert got.status_code == 200 and got.json()["templateID"] == info.template_id, (i, got.text)
    with Sandbox.create(name) as sbx:  # and through the gateway
        assert sbx.commands.run("cat /opt/b").stdout == outputs[builder].splitlines(keepends=True)[0]
    listed = httpx.get(cluster.gw + "/templates", headers=KEY, trust_env=False).json()
    assert [t["templateID"] for t in listed].count(info.template_id) == 1

    # deleting it through the gateway: gone from every node and from the store
    gone = httpx.delete(f"{cluster.gw}/templates/{info.template_id}", headers=KEY, trust_env=False, timeout=120)
    assert gone.status_code == 204, gone.text
    for i in range(NODES):
        assert httpx.get(f"{cluster.url(i)}/templates/{info.template_id}", headers=KEY,
                         trust_env=False).status_code == 404  # fmt: skip
    assert not list((cluster.store / "templates").glob("*.json"))
    assert not list((cluster.store / "template-names").glob("*.json"))
    assert not list((cluster.store / "manifests").glob("*.json"))  # its snapshot too
    made = httpx.post(cluster.gw + "/v2/sandboxes", json={"templateID": name}, headers=KEY, trust_env=False)
    assert made.status_code == 404, made.text
    assert not Template.exists(name)

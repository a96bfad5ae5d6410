"""Lazy images in cluster mode: two ``aenv serve`` nodes (ns) binding in Redis and sharing one ``file://``
snapshot store, with nothing about lazy images set. Cluster mode turns them on and keeps their artifacts
in that store (or the image's registry), so a registry image is converted once per cluster: the node that
pulled it first converts it, a second node starts it on demand from the artifact and converts nothing,
and two nodes that pull the same image at once (a pull through the gateway) convert it once between them
(the claim in the store)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from aenv.cluster.redis_proc import RedisProc
from aenv.images.registry import RegistryClient
from aenv.testing.gateway import wait_for
from tests.fixtures.directory_cluster import KEY, DirectoryCluster, running
from tests.fixtures.lazyimage import build_layers, drop_local_copy, push_unique
from tests.fixtures.plugin import PushedImages
from tests.fixtures.redis import redis_server  # noqa: F401

pytestmark = pytest.mark.timeout(900)


class Cluster(DirectoryCluster):
    def __init__(self, tmp: Path, redis_url: str) -> None:
        self.store = tmp / "store"
        super().__init__(tmp, redis_url, {"AENV_SNAPSHOT_STORE": f"file://{self.store}", "AENV_POOL_SIZE": "0"})

    def caps(self, i: int) -> dict[str, Any]:
        info = httpx.get(self.url(i) + "/aenv/info", headers=KEY, trust_env=False).json()
        return dict(info["capabilities"])

    def converted(self) -> int:
        """Conversions the nodes ran, together."""
        return sum(int(self.caps(i)["lazy_conversions"]) for i in (0, 1))

    def lazy_images(self, i: int) -> list[str]:
        got = httpx.get(self.url(i) + "/aenv/cache", headers=KEY, trust_env=False).json()
        return [img["name"] for img in got["lazy"]["images"]]

    def pull(self, url: str, image: str, name: str) -> dict[str, Any]:
        r = httpx.post(url + "/aenv/templates/pull", json={"image": image, "name": name}, headers=KEY,
                       trust_env=False, timeout=600)  # fmt: skip
        assert r.status_code == 200, r.text
        return dict(json.loads(r.text.splitlines()[-1]))

    def logs(self) -> str:
        return "".join((self.tmp / f"n{i + 1}" / "server.log").read_text(errors="replace") for i in (0, 1))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisProc,  # noqa: F811
            pushed_images: PushedImages) -> Iterator[Cluster]:  # fmt: skip
    with running(Cluster(tmp_path_factory.mktemp("gwlazy"), redis_server.url), redis_server, pushed_images) as c:
        yield c


@pytest.fixture(scope="module")
def fresh(cluster: Cluster, pushed_images: PushedImages, tmp_path_factory: pytest.TempPathFactory) -> Callable[[], str]:
    """Images no node, cache or registry has seen (busybox and a few MiB, under a digest of their own)."""
    layers, cmd = build_layers(tmp_path_factory.mktemp("fresh"), 4)

    def push() -> str:
        async def go() -> str:
            async with RegistryClient(mirrors={"docker.io": pushed_images.registry.url}) as client:
                return (await push_unique(client, "aenv/lazy-once", layers, cmd))[0]

        return asyncio.run(go())

    return push


def test_lazy_images_are_on_in_cluster_mode(cluster: Cluster) -> None:
    for i in (0, 1):
        caps = cluster.caps(i)
        assert caps["lazy_images"] is True, caps


def test_an_image_pulled_on_one_node_is_converted_once(cluster: Cluster, pushed_images: PushedImages,
                                                       fresh: Callable[[], str]) -> None:  # fmt: skip
    from e2b import Sandbox

    image, before = fresh(), cluster.converted()
    cluster.pull(cluster.url(0), image, "once")  # pulled whole on n1, converted there in the background
    wait_for(lambda: f"lazy image of docker.io/{image}" in cluster.logs() and cluster.converted() == before + 1,
             timeout=300)  # fmt: skip
    drop_local_copy(pushed_images.registry.url, image)  # the test nodes share a cache dir: n2 must not find it
    lazy_before = len(cluster.lazy_images(1))
    cluster.pull(cluster.url(1), image, "once")  # n2 finds the artifact: on demand, no conversion
    assert len(cluster.lazy_images(1)) == lazy_before + 1
    made = httpx.post(cluster.url(1) + "/v2/sandboxes", json={"templateID": "once"}, headers=KEY, trust_env=False)
    assert made.status_code == 201, made.text
    sbx = Sandbox.connect(made.json()["sandboxID"])
    try:
        assert "BusyBox" in sbx.commands.run("busybox | head -1").stdout
    finally:
        sbx.kill()
    assert cluster.converted() == before + 1


def test_two_nodes_pulling_at_once_convert_once(cluster: Cluster, fresh: Callable[[], str]) -> None:
    image, before = fresh(), cluster.converted()
    last = cluster.pull(cluster.gw, image, "twice")  # the gateway sends the pull to both nodes at once
    assert sorted(last["nodes"]) == ["n1", "n2"], last
    wait_for(lambda: f"lazy image of docker.io/{image}" in cluster.logs(), timeout=300)
    assert cluster.converted() == before + 1  # one node converted it; the other left it, or found it done

"""Lazy images at the issue's scale, through the server and the SDK, on the runtime under test
(``AENV_TEST_RUNTIME``: ns by default, vm for the microVM runtime, where the lazy file is the raw
backing of the template disk).

Three images of 1 GiB each (busybox plus 600 MiB of random files), each under a digest of its own
and with its own lazy artifact, served by a local registry behind a 1 Gbit/s throttle to a server
whose chunk cache is 512 MiB:

* the first sandbox of a new image starts having fetched only the chunks it touched, at 1 Gbit/s and
  at 100 Mbit/s;
* one sandbox per image runs side by side, each reading 200 MiB of its image (600 MiB in all, over the
  budget), and every byte read is right, also when the first reads again what the others evicted.

Slow (minutes: building, converting and publishing the image), so by hand: ``-m slow``.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from aenv.images.lazy.format import LazyIndex
from aenv.images.lazy.lazyd import LazyDaemon, fuse_support
from aenv.images.lazy.publish import find_in_registry
from aenv.images.reference import parse_reference
from aenv.images.registry import RegistryClient
from aenv.images.templates import ImageBuilder
from aenv.testing.server import API_KEY, Server, discard_vm_state, start_server, stop_server
from tests.fixtures.lazyimage import build_layers, push_unique, republish_lazy
from tests.fixtures.oci import Layer
from tests.fixtures.plugin import PushedImages, make_settings
from tests.fixtures.throttle import Throttle
from tests.integration.conftest import _needs_runtime
from tests.integration.test_pull_sdk import aenv

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(fuse_support() is not None, reason=f"no FUSE here: {fuse_support()}"),
]

PAYLOAD_MIB = 600
BUDGET = 512 << 20
READ = [f"blob{k:04d}" for k in range(25)]  # 25 files of 8 MiB: 200 MiB of each image


@dataclass
class Images:
    refs: list[str]  # three for side by side, a fourth for the cold start at 100 Mbit/s
    index: LazyIndex
    hashes: dict[str, str]  # payload file -> sha256, from the layer itself


def _payload_hashes(layer: Layer, names: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name in names:
        cat = subprocess.run(["tar", "--zstd", "-xOf", str(layer.path), f"./payload/{name}"],
                             capture_output=True, check=True)  # fmt: skip
        out[name] = subprocess.run(["sha256sum"], input=cat.stdout, capture_output=True,
                                   check=True).stdout.split()[0].decode()  # fmt: skip
    return out


@pytest.fixture(scope="module")
def gib_images(tmp_path_factory: pytest.TempPathFactory, pushed_images: PushedImages) -> Images:
    """Three digests of one 1 GiB image, each with a lazy artifact (converted once by another node)."""
    tmp = tmp_path_factory.mktemp("gib")
    layers, cmd = build_layers(tmp, PAYLOAD_MIB)
    url = pushed_images.registry.url

    async def go() -> Images:
        async with RegistryClient(mirrors={"docker.io": url}) as client:
            first, _, _ = await push_unique(client, "aenv/lazy-gib", layers, cmd)
        s = make_settings(tmp / "node-a", None, registry_mirrors={"docker.io": url}, lazy_images=True)
        b = ImageBuilder(s)
        try:
            await b.pull(first)
            await b.lazy.wait_converted()
        finally:
            await b.aclose()
        async with RegistryClient(mirrors={"docker.io": url}) as client:
            ref = parse_reference(first)
            art = await find_in_registry(client, ref, (await client.resolve(ref)).manifest_digest)
            assert art is not None, "the first node published no lazy artifact"
            refs = [first]
            for _ in range(3):
                other, digest, size = await push_unique(client, "aenv/lazy-gib", layers, cmd)
                await republish_lazy(client, other, digest, size, art.index)
                refs.append(other)
        return Images(refs, art.index, _payload_hashes(layers[-1], READ))

    images = asyncio.run(go())
    shutil.rmtree(tmp / "node-a", ignore_errors=True)
    return images


@pytest.fixture(scope="module")
def link(pushed_images: PushedImages) -> Iterator[Throttle]:
    thr = Throttle(int(pushed_images.registry.host.rsplit(":", 1)[1]), bits_per_s=1e9, rtt=0.001)
    yield thr
    thr.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, runtime_name: str, link: Throttle) -> Iterator[Server]:
    _needs_runtime(runtime_name)
    srv = start_server(tmp_path_factory.mktemp("lazy-gib"), runtime_name, {
        "AENV_REGISTRY_MIRRORS": f"docker.io=http://127.0.0.1:{link.port}", "AENV_POOL_SIZE": "0",
        "AENV_LAZY_IMAGES": "true", "AENV_LAZY_CACHE_BYTES": str(BUDGET),
    })  # fmt: skip
    yield srv
    stop_server(srv)
    discard_vm_state(srv.state_dir)
    for root in sorted((srv.state_dir / "lazy" / "roots").glob("*")):
        subprocess.run(["umount", str(root)], check=False, capture_output=True)
    LazyDaemon(srv.state_dir / "lazy", 0).stop()


def _lazy_listing(srv: Server) -> list[dict[str, object]]:
    images: list[dict[str, object]] = json.loads(aenv(srv, "cache", "ls", "-o", "json").stdout)["lazy"]["images"]
    return images


def _sha_of(sbx: object, names: list[str], runtime: str) -> dict[str, str]:
    """sha256 of the named payload files, as the sandbox reads them. A TCG guest hashes at a few MB/s,
    so there every file is read whole (``cat``: the chunks are fetched all the same) and every fourth
    is hashed."""
    paths = " ".join(f"/payload/{n}" for n in names)
    hashed = _hashed(names, runtime)
    cmd = f"sha256sum {' '.join(f'/payload/{n}' for n in hashed)}"
    if hashed != names:
        cmd = f"cat {paths} > /dev/null && {cmd}"
    out = sbx.commands.run(cmd, timeout=1200).stdout  # type: ignore[attr-defined]
    return {line.split()[1].rsplit("/", 1)[1]: line.split()[0] for line in out.splitlines() if line.strip()}


def _hashed(names: list[str], runtime: str) -> list[str]:
    return names if runtime != "vm" else names[::4]


def _want(images: Images, names: list[str], runtime: str) -> dict[str, str]:
    return {n: images.hashes[n] for n in _hashed(names, runtime)}


@pytest.mark.parametrize(("bits_per_s", "rtt", "k"), [(1e9, 0.001, 0), (1e8, 0.010, 3)], ids=["1Gbit", "100Mbit"])
def test_a_gib_image_starts_having_fetched_only_what_it_touched(
    server: Server, gib_images: Images, link: Throttle, bits_per_s: float, rtt: float, k: int
) -> None:
    from e2b import Sandbox

    link.rate, link.rtt = bits_per_s / 8, rtt
    before = link.bytes
    try:
        assert aenv(server, "pull", gib_images.refs[k], "--name", f"gib{k}").returncode == 0
        sbx = Sandbox.create(f"gib{k}", api_url=server.url, sandbox_url=server.url, api_key=API_KEY)
        try:
            assert "blob0000" in sbx.commands.run("busybox true && ls /payload | head -1").stdout
            fetched = link.bytes - before
        finally:
            sbx.kill()
    finally:
        link.rate, link.rtt = 1e9 / 8, 0.001
    stored = gib_images.index.stored_bytes
    assert stored > 600 << 20 and fetched < stored // 20, f"{fetched} of {stored} bytes fetched to start"
    (img,) = [i for i in _lazy_listing(server) if i["templates"] == [f"gib{k}"]]
    assert 0 < int(str(img["fetched"])) < stored // 20


@pytest.mark.timeout(1800)
def test_three_gib_images_run_side_by_side_under_a_512_mib_budget(
    server: Server, gib_images: Images, runtime_name: str
) -> None:
    from e2b import Sandbox

    for k, ref in enumerate(gib_images.refs):
        if not any(i["templates"] == [f"gib{k}"] for i in _lazy_listing(server)):
            assert aenv(server, "pull", ref, "--name", f"gib{k}").returncode == 0
    sandboxes = [Sandbox.create(f"gib{k}", api_url=server.url, sandbox_url=server.url, api_key=API_KEY, timeout=900)
                 for k in range(3)]  # fmt: skip
    try:
        for sbx in sandboxes:  # 200 MiB of each image while all three run: 600 MiB over a 512 MiB budget
            assert _sha_of(sbx, READ, runtime_name) == _want(gib_images, READ, runtime_name)
        again = READ[:12]  # evicted by the others' reads: fetched again, still exact
        assert _sha_of(sandboxes[0], again, runtime_name) == _want(gib_images, again, runtime_name)
        for sbx in sandboxes:
            assert sbx.is_running()
    finally:
        for sbx in sandboxes:
            sbx.kill()
    side_by_side = {f"gib{k}" for k in range(3)}
    listing = [i for i in _lazy_listing(server) if side_by_side & set(i["templates"])]  # type: ignore[arg-type]
    assert len(listing) == 3
    cached = sum(int(str(i["cached"])) for i in _lazy_listing(server))  # every lazy image on one budget
    assert cached <= BUDGET, f"{cached} bytes cached over a budget of {BUDGET}"
    assert int(str(listing[0]["evictions"])) > 0
    assert all(int(str(i["fetched"])) > 100 << 20 for i in listing)  # each read its own chunks

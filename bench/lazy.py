"""Scenario ``lazy``: cold create → first command of a big image, started on demand vs pulled whole.

It brings its own registry (Debian's docker-registry) behind a throttling proxy (1 Gbit/s with 1 ms,
then 100 Mbit/s with 10 ms) and two servers of the bench's runtime with fresh image caches: one with
``lazy_images`` on, one without. The image is busybox plus a payload of random files (1 GiB in all;
32 MiB with ``--smoke``). Its lazy artifact is made once (pull whole, convert, publish, as a first node
would); every sample then pushes the same layers under a digest nobody has seen (and, for the lazy
server, gives that digest the same artifact), so each sample is a cold start: no layer, chunk or page
cached. Measured from the pull request to the first command's answer. After each full-pull sample
the template is deleted and the layer cache pruned. Rows: time, bytes fetched through the proxy, disk
used (lazy: the chunk cache file's allocated bytes; full: the image and layer caches).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from aenv.images.lazy.lazyd import LazyDaemon, fuse_support
from aenv.images.lazy.publish import find_in_registry
from aenv.images.lazy.service import lazy_name
from aenv.images.reference import parse_reference
from aenv.images.registry import RegistryClient
from aenv.images.templates import ImageBuilder
from aenv.testing.server import API_KEY, Server, start_server, stop_server
from bench.context import Ctx
from bench.rows import Row, row, scenario
from tests.fixtures.lazyimage import build_layers, push_unique, republish_lazy
from tests.fixtures.plugin import make_settings
from tests.fixtures.registry import start_registry
from tests.fixtures.throttle import Throttle

BANDWIDTHS = ((1e9, 0.001, "1 Gbit/s"), (1e8, 0.010, "100 Mbit/s"))
REPO = "aenv/lazy-bench"
FIRST_CMD = "busybox true && id -un && ls /payload | head -1"
KEEP = {"images", "layers", "lazy-build"}  # what each server gets fresh in its own cache dir


def lazy_start(ctx: Ctx) -> dict[str, Any]:
    """Lazy images: cold create → first command, lazy vs full pull, at 1 Gbit/s and 100 Mbit/s"""
    why = fuse_support()
    if why is not None:
        return scenario("lazy images", [], [f"skipped: {why}"])
    payload = 32 if ctx.smoke else 1000
    n = ctx.n(1, 3, vm=2)
    with tempfile.TemporaryDirectory(prefix="aenv-bench-lazy-") as t, contextlib.ExitStack() as stack:
        tmp = Path(t)
        reg = start_registry(tmp / "registry")
        stack.callback(reg.stop)
        thr = Throttle(int(reg.host.rsplit(":", 1)[1]), bits_per_s=1e9)
        stack.callback(thr.close)
        layers, cmd = build_layers(tmp, payload)
        index, size_mib = asyncio.run(_first_node(tmp / "node-a", reg.url, layers, cmd))
        mirror = f"docker.io=http://127.0.0.1:{thr.port}"
        lazy_srv = stack.enter_context(_server(tmp / "lazy", ctx.runtime, mirror, lazy=True))
        full_srv = stack.enter_context(_server(tmp / "full", ctx.runtime, mirror, lazy=False))

        def push(lazy: bool) -> str:
            async def go() -> str:
                async with RegistryClient(mirrors={"docker.io": reg.url}) as client:
                    ref, digest, msize = await push_unique(client, REPO, layers, cmd)
                    if lazy:
                        await republish_lazy(client, ref, digest, msize, index)
                    return ref

            return asyncio.run(go())

        _sample(lazy_srv, push(True), thr)  # warm-up: starts the node's aenv-lazyd, not recorded
        rows: list[Row] = []
        notes = [f"image: {size_mib} MiB ext4 ({payload} MiB random payload + busybox); "
                 f"{index.stored_bytes / 2**20:.0f} MiB stored in {len(index.chunks)} chunks"]  # fmt: skip
        for bps, rtt, label in BANDWIDTHS:
            thr.rate, thr.rtt = bps / 8, rtt
            got: dict[str, list[dict[str, float]]] = {"lazy": [], "full": []}
            for i in range(n):
                order = ("lazy", "full") if i % 2 == 0 else ("full", "lazy")
                for mode in order:
                    if mode == "full" and bps < 1e9 and got["full"] and not ctx.smoke:
                        continue  # a whole pull at 100 Mbit/s takes minutes: one sample
                    srv = lazy_srv if mode == "lazy" else full_srv
                    got[mode].append(_sample(srv, push(mode == "lazy"), thr))
            for mode, samples in got.items():
                system = f"aenv-{ctx.runtime} lazy" if mode == "lazy" else f"full pull (aenv-{ctx.runtime})"
                rows.append(row(f"first command, cold, {label}", system, [s["ms"] for s in samples]))
                rows.append(row(f"fetched, {label}", system, [s["fetched_mb"] for s in samples], unit="MB"))
                rows.append(row(f"disk used, {label}", system, [s["disk_mb"] for s in samples], unit="MB"))
                if mode == "lazy":
                    rows.append(
                        row(f"chunks touched, {label}", system, [s["touched_mb"] for s in samples], unit="MB")
                    )
            lz, fl = (sorted(s["ms"] for s in got[m]) for m in ("lazy", "full"))
            if lz and fl:
                notes.append(
                    f"{label}: lazy {fl[len(fl) // 2] / lz[len(lz) // 2]:.1f}x faster than the full pull (medians)"
                )
        return scenario("lazy images: cold create → first command (registry behind a throttle)", rows, notes)


async def _first_node(tmp: Path, registry_url: str, layers: list[Any], cmd: list[str]) -> tuple[Any, int]:
    """Push, pull whole with lazy on (which converts and publishes), and return the artifact's index."""
    async with RegistryClient(mirrors={"docker.io": registry_url}) as client:
        ref, digest, _ = await push_unique(client, REPO, layers, cmd)
    s = make_settings(tmp, None, registry_mirrors={"docker.io": registry_url}, lazy_images=True)
    b = ImageBuilder(s)
    try:
        await b.pull(ref)
        await b.lazy.wait_converted()
        art = await find_in_registry(b.client, parse_reference(ref), digest)
    finally:
        await b.aclose()
        shutil.rmtree(tmp, ignore_errors=True)
    if art is None:
        raise RuntimeError("the first node published no lazy artifact (see its log)")
    return art.index, art.index.size >> 20


@contextlib.contextmanager
def _server(tmp: Path, runtime: str, mirror: str, *, lazy: bool) -> Iterator[Server]:
    """A server with its own image caches (the rest of the shared cache dir linked in: base rootfs, tools)."""
    from aenv.config import load_settings

    shared = Path(load_settings().cache_dir)
    cache = tmp / "cache"
    cache.mkdir(parents=True)
    for entry in shared.iterdir():
        if entry.name not in KEEP:
            (cache / entry.name).symlink_to(entry)
    env = {"AENV_REGISTRY_MIRRORS": mirror, "AENV_POOL_SIZE": "0", "AENV_CACHE_DIR": str(cache),
           "AENV_LAZY_IMAGES": "true" if lazy else "false", "AENV_LAZY_CACHE_BYTES": str(4 << 30)}  # fmt: skip
    srv = start_server(tmp, runtime, env)
    try:
        yield srv
    finally:
        stop_server(srv)
        for root in sorted((srv.state_dir / "lazy" / "roots").glob("*")):
            subprocess.run(["umount", str(root)], check=False, capture_output=True)
        LazyDaemon(srv.state_dir / "lazy", 0).stop()


def _sample(srv: Server, ref: str, thr: Throttle) -> dict[str, float]:
    from e2b import Sandbox

    hdr = {"X-API-KEY": API_KEY}
    name = "s" + ref.rsplit(":", 1)[1]
    before = thr.bytes
    with httpx.Client(base_url=srv.url, headers=hdr, timeout=900, trust_env=False) as http:
        t0 = time.perf_counter()
        with http.stream("POST", "/aenv/templates/pull", json={"image": ref, "name": name}) as resp:
            lines = list(resp.iter_lines())
        if resp.status_code != 200 or '"error"' in (lines[-1] if lines else ""):
            raise RuntimeError(f"pull {ref}: HTTP {resp.status_code} {lines[-1:]}")
        sbx = Sandbox.create(name, api_url=srv.url, sandbox_url=srv.url, api_key=API_KEY)
        try:
            out = sbx.commands.run(FIRST_CMD)
            ms = (time.perf_counter() - t0) * 1000
            assert "blob0000" in out.stdout, out.stdout
        finally:
            sbx.kill()
        fetched = thr.bytes - before
        listing = http.get("/aenv/cache").json()
        lazy = [i for i in listing.get("lazy", {}).get("images", []) if name in i.get("templates", [])]
        if lazy:
            disk = lazy[0]["disk"] + _size(srv.state_dir / "lazy" / "cache" / "chunks.db")
            touched = lazy[0]["cached"]
        else:
            disk = listing["usage"]["used"] + _du(Path(srv.env["AENV_CACHE_DIR"]) / "images")
            touched = 0
            http.delete(f"/templates/{name}")
            http.post("/aenv/cache/prune", params={"all": "true"})
    mb = 1e6
    return {"ms": ms, "fetched_mb": fetched / mb, "disk_mb": disk / mb, "touched_mb": touched / mb}


def _size(p: Path) -> int:
    with contextlib.suppress(OSError):
        return os.stat(p).st_size
    return 0


def _du(p: Path) -> int:
    r = subprocess.run(["du", "-sxB1", str(p)], capture_output=True, text=True, check=False)
    return int(r.stdout.split()[0]) if r.returncode == 0 and r.stdout else 0


__all__ = ["lazy_start", "lazy_name"]

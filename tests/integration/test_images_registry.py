"""The image pipeline against a real Debian ``docker-registry`` holding images pushed by our own client."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from aenv.images.errors import DigestMismatch, ManifestNotFound, RegistryUnavailable  # noqa: E402
from aenv.images.lookup import lookup  # noqa: E402
from aenv.images.registry import RegistryClient  # noqa: E402
from aenv.images.templates import ImageBuilder, PulledImage  # noqa: E402
from tests.fixtures.oci import image_config, layer_from_tar, push_image, tar_entries  # noqa: E402
from tests.fixtures.plugin import PushedImages, make_settings  # noqa: E402
from tests.fixtures.registry import LocalRegistry, free_port, start_registry  # noqa: E402

IMAGES = [
    "busybox:latest",
    "busybox:multi",
    "busybox:docker",
    "ubuntu:22.04",
    "aenv/debian-app:1",
    "alpine:3.23",
]


def builder(tmp: Path, reg: LocalRegistry | None, **kw: object) -> ImageBuilder:
    s = make_settings(tmp, reg, **kw)
    return ImageBuilder(s, client=RegistryClient.from_settings(s, attempts=3, backoff=0.01))


def run_in(tpl: PulledImage, mnt: Path, script: str) -> str:
    """Mount the template as the ns runtime would (read-only overlay of its lowers) and run a command."""
    mnt.mkdir()
    lowers = ":".join(str(p) for p in tpl.lowers)
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", f"ro,lowerdir={lowers}", str(mnt)], check=True)
    try:
        return subprocess.run(
            ["chroot", str(mnt), "/bin/sh", "-c", script], capture_output=True, text=True, check=True
        ).stdout
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.parametrize("name", ["busybox:latest", "debian:bookworm", "aenv/debian-app:1", "alpine:3.23"])
def test_skopeo_accepts_our_pushes(pushed_images: PushedImages, name: str) -> None:
    digest = pushed_images.require(name)
    if shutil.which("skopeo") is None:
        pytest.skip("skopeo not installed")
    repo = name if "/" in name else f"library/{name}"
    out = subprocess.run(
        ["skopeo", "inspect", "--tls-verify=false", f"docker://{pushed_images.registry.host}/{repo}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    doc = json.loads(out)
    assert doc["Digest"] == digest and doc["Os"] == "linux" and doc["Architecture"] == "amd64"


@pytest.mark.parametrize("name", IMAGES)
async def test_pull_fixture_image_through_mirror(
    pushed_images: PushedImages, tmp_path: Path, name: str
) -> None:
    pushed_images.require(name)
    b = builder(tmp_path, pushed_images.registry)
    try:
        tpl = await b.pull(name)
    finally:
        await b.aclose()
    assert tpl.reference.startswith("docker.io/")
    assert all(p.is_dir() for p in tpl.layers)
    passwd = lookup(tpl.lowers, "etc/passwd")
    assert passwd is not None and "\nuser:x:1000:1000:" in "\n" + passwd.read_text()
    assert lookup(tpl.lowers, "home/user") is not None
    assert lookup(tpl.lowers, "bin/sh") is not None
    if "debian" in name or "ubuntu" in name:
        assert lookup(tpl.lowers, "usr/bin/python3") is not None
    if name.startswith("aenv/debian-app"):
        assert lookup(tpl.lowers, "etc/motd") is None  # whited out by layer 3
        assert tpl.config.workdir == "/opt/app" and tpl.start_cmd == "python3 /opt/app/hello.py"
    if os.geteuid() == 0:
        out = run_in(tpl, tmp_path / "mnt", "id -u user; ls -d /home/user; ls /bin/sh")
        assert out.split()[0] == "1000"
        if "debian" in name or "ubuntu" in name:
            out = run_in(tpl, tmp_path / "mnt2", "python3 -c 'import sys; print(sys.version_info[0])'")
            assert out.strip() == "3"


async def test_shared_layers_are_stored_once(pushed_images: PushedImages, tmp_path: Path) -> None:
    pushed_images.require("debian:bookworm")
    pushed_images.require("aenv/debian-app:1")
    b = builder(tmp_path, pushed_images.registry)
    try:
        base = await b.pull("debian:bookworm")
        app = await b.pull("aenv/debian-app:1")
        same = await b.pull("ubuntu:22.04")  # the same manifest under another name
        assert b.cache.usage().entries == 3
    finally:
        await b.aclose()
    assert app.layers_reused == 2 and app.layers[:2] == base.layers
    assert app.download_bytes < 10_000  # only the tiny app layer moved
    assert same.download_bytes == 0 and same.path == base.path


async def test_unknown_tag_names_the_reference(pushed_images: PushedImages, tmp_path: Path) -> None:
    b = builder(tmp_path, pushed_images.registry)
    try:
        with pytest.raises(ManifestNotFound) as e:
            await b.pull("ubuntu:99.99")
        with pytest.raises(ManifestNotFound, match="docker.io/nobody/nothing:latest"):
            await b.pull("nobody/nothing")
    finally:
        await b.aclose()
    assert "docker.io/library/ubuntu:99.99" in str(e.value)


async def test_registry_down_is_retried_then_clear(tmp_path: Path) -> None:
    s = make_settings(tmp_path, None, registry_mirrors={"docker.io": f"http://127.0.0.1:{free_port()}"})
    b = ImageBuilder(s, client=RegistryClient.from_settings(s, attempts=3, backoff=0.01))
    try:
        with pytest.raises(RegistryUnavailable) as e:
            await b.pull("ubuntu:22.04")
    finally:
        await b.aclose()
    assert e.value.context["attempts"] == 3
    assert "docker.io/library/ubuntu:22.04" in str(e.value) and "ConnectError" in str(e.value)


async def test_corrupted_blob_is_rejected_and_not_cached(
    local_registry: LocalRegistry, tmp_path: Path
) -> None:
    import tarfile

    t = tarfile.TarInfo("unique.txt")
    t.mtime = 0
    tar = tar_entries(tmp_path / "l.tar", [(t, os.urandom(2048))])
    layer = layer_from_tar(tar, tmp_path / "l.tar.gz", "gzip")
    async with RegistryClient(mirrors={"docker.io": local_registry.url}) as c:
        await push_image(c, "corrupt/img:1", [layer], image_config([layer]))
    hexd = layer.digest.split(":")[1]
    data = local_registry.root / "data/docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    b = builder(tmp_path / "c", local_registry)
    try:
        with pytest.raises(DigestMismatch) as e:
            await b.pull("corrupt/img:1")
        assert b.cache.usage().entries == 0
    finally:
        await b.aclose()
    assert "corrupt/img:1" in str(e.value)
    assert list((tmp_path / "c/cache/layers/unpacked").iterdir()) == []
    assert [p for p in (tmp_path / "c/cache/images").iterdir()] == []


async def test_budget_enforced_pinned_layers_survive(pushed_images: PushedImages, tmp_path: Path) -> None:
    """Pull more than the budget: the unpinned LRU image goes, the in-use one stays."""
    for n in ("alpine:3.23", "busybox:latest", "aenv/debian-app:1"):
        pushed_images.require(n)
    b = builder(tmp_path, pushed_images.registry)
    try:
        busybox = await b.pull("busybox:latest")
        b.release_image(busybox.manifest_digest)  # its template was deleted: evictable now
        app = await b.pull("aenv/debian-app:1")
        b.cache.pin("sandbox:sbx1", app.layer_digests)  # a sandbox runs on it...
        b.release_image(app.manifest_digest)  # ...even after its template is deleted
        # room for the Debian image and alpine, but not for busybox on top
        b.cache.budget = app.size + 87_000_000 + busybox.size // 2
        alpine = await b.pull("alpine:3.23")
        assert alpine.size < 87_000_000 + busybox.size // 2  # the premise of the test
        used = b.cache.usage().used
        assert used <= b.cache.budget, (used, b.cache.budget)
        assert all(p.is_dir() for p in app.layers)  # pinned by the sandbox: survived
        assert all(p.is_dir() for p in alpine.layers)
        assert not any(p.exists() for p in busybox.layers)  # unpinned, least recently used: evicted
    finally:
        await b.aclose()


async def test_concurrent_pulls_share_the_download(pushed_images: PushedImages, tmp_path: Path) -> None:
    pushed_images.require("alpine:3.23")
    b = builder(tmp_path, pushed_images.registry)
    try:
        tpls = await asyncio.gather(*(b.pull("alpine:3.23") for _ in range(3)))
        assert b.cache.downloads == 1
    finally:
        await b.aclose()
    assert len({t.path for t in tpls}) == 1


async def test_registry_restart_keeps_cache_consistent(tmp_path: Path) -> None:
    """A registry that dies mid-session: the pull fails clearly and nothing half-written remains."""
    reg = start_registry(tmp_path / "reg")
    import tarfile

    t = tarfile.TarInfo("f")
    t.mtime = 0
    layer = layer_from_tar(tar_entries(tmp_path / "l.tar", [(t, b"x" * 100)]), tmp_path / "l.gz", "gzip")
    try:
        async with RegistryClient(mirrors={"docker.io": reg.url}) as c:
            await push_image(c, "dies/img:1", [layer], image_config([layer]))
        b = builder(tmp_path / "c", reg)
        await b.client.resolve(
            __import__("aenv.images.reference", fromlist=["x"]).parse_reference("dies/img:1")
        )
    finally:
        reg.stop()
    try:
        with pytest.raises(RegistryUnavailable):
            await b.pull("dies/img:1")
        assert b.cache.usage().entries == 0
    finally:
        await b.aclose()
    assert list((tmp_path / "c/cache/images").iterdir()) == []

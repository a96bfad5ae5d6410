"""LazyImages without a daemon: off unless asked, and the daemon's errors forwarded to the server's log."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.images.lazy import publish as pub
from aenv.images.lazy import service
from aenv.images.lazy.service import LazyImages, store_of
from aenv.images.registry import RegistryClient


async def test_off_by_default_and_says_why(tmp_path: Path) -> None:
    async with RegistryClient() as client:
        lazy = LazyImages(Settings(state_dir=tmp_path / "s", cache_dir=tmp_path / "c"), client)
        assert not lazy.available
        assert lazy.describe() == {"lazy_images": False, "lazy_images_reason": "off (lazy_images = false)",
                                   "lazy_conversions": 0}
        assert lazy.listing() == []


async def test_daemon_errors_reach_the_server_log(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with RegistryClient() as client:
        lazy = LazyImages(Settings(state_dir=tmp_path / "s", cache_dir=tmp_path / "c"), client)
        log = lazy.daemon.root / "daemon.log"
        log.parent.mkdir(parents=True)
        log.write_text("t INFO aenv.lazy serving\nt ERROR aenv.lazy lazy fetch failed image=x chunks=1-2: down\n")
        with caplog.at_level(logging.ERROR, "aenv.lazy"):
            assert lazy.forward_errors() == 1
            assert lazy.forward_errors() == 0  # only new lines
            with open(log, "a") as fh:
                fh.write("t ERROR aenv.lazy lazy chunk refused image=x: chunk 3: sha256 …\npartial")
            assert lazy.forward_errors() == 1
        assert "aenv-lazyd: aenv.lazy lazy fetch failed image=x" in caplog.text
        assert "chunk refused" in caplog.text


class _SlowDaemon:
    """A daemon that is dead until ``ensure`` (slow) starts it; every remount is recorded."""

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.up = False

    def registered(self) -> list[str]:
        return ["img"]

    def alive(self) -> bool:
        return self.up

    def ensure(self) -> None:
        time.sleep(0.2)
        self.up = True
        self.events.append("daemon up")

    def path_of(self, name: str) -> Path:
        return Path("/nonexistent") / name


async def test_a_create_during_a_restart_waits_for_the_remount(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon is back before its roots are remounted: a sandbox that starts in between must not land
    on the old, dead mount (CI saw ``cwd '/root' does not exist``)."""
    events: list[str] = []
    monkeypatch.setattr(service, "_mount_ro_ext4", lambda _img, where: events.append(f"mounted {where.name}"))
    async with RegistryClient() as client:
        lazy = LazyImages(Settings(state_dir=tmp_path / "s", cache_dir=tmp_path / "c"), client)
        lazy.daemon = _SlowDaemon(events)  # type: ignore[assignment]
        (lazy.roots / "img").mkdir(parents=True)
        healing = asyncio.create_task(lazy.heal())
        while not events and not lazy._healing.locked():
            await asyncio.sleep(0)
        await lazy.ready()
        events.append("sandbox starts")
        assert await healing is True
        assert events == ["daemon up", "mounted img", "sandbox starts"]
        assert await lazy.heal() is False  # alive: nothing to do


def test_cluster_mode_turns_lazy_images_on_with_the_shared_store(tmp_path: Path) -> None:
    single = Settings(state_dir=tmp_path / "s", snapshot_store="file:///shared")
    assert not single.lazy_images and single.lazy_store is None  # a single machine keeps its defaults
    node = Settings(state_dir=tmp_path / "s", cluster_redis="redis://127.0.0.1:1", snapshot_store="file:///shared")
    assert node.lazy_images and node.lazy_store == "file:///shared"
    assert store_of(node) == Path("/shared")
    own = Settings(state_dir=tmp_path / "s", cluster_redis="redis://127.0.0.1:1")
    assert own.lazy_images and own.lazy_store is None  # no shared store set: the node's own
    off = Settings(state_dir=tmp_path / "s", cluster_redis="redis://127.0.0.1:1", lazy_images=False,
                   snapshot_store="file:///shared", lazy_store="/elsewhere")  # fmt: skip
    assert not off.lazy_images and off.lazy_store == "/elsewhere"  # what is set stays


async def test_one_conversion_per_store_and_a_stale_claim_is_taken_over(tmp_path: Path) -> None:
    digest = "sha256:" + "ab" * 32
    store = tmp_path / "store"
    assert await pub.claim(store, digest, "n1")
    assert not await pub.claim(store, digest, "n2")  # n1 converts it
    claim = store / pub.claim_key(digest)
    claim.write_text(json.dumps({"holder": "n1", "at": time.time() - pub.CLAIM_STALE_S - 1}))
    assert await pub.claim(store, digest, "n2")  # n1 died converting: n2 takes over
    assert json.loads(claim.read_text())["holder"] == "n2"


async def test_a_store_artifact_is_published_found_and_deleted(tmp_path: Path) -> None:
    digest = "sha256:" + "cd" * 32
    store = tmp_path / "store"
    img = tmp_path / "img"
    img.write_bytes(b"x" * 3000 + bytes(1 << 20))
    art = await pub.publish_to_store(store, digest, img, tmp_path)
    found = await pub.find_in_store(store, digest)
    assert found is not None and found.index == art.index and len(art.index.chunks) == 2
    assert await pub.claim(store, digest, "n1")
    await pub.delete_from_store(store, digest)
    assert await pub.find_in_store(store, digest) is None and not pub.store_dir(store, digest).exists()

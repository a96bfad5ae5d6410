"""LazyImages without a daemon: off unless asked, and the daemon's errors forwarded to the server's log."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.images.lazy import service
from aenv.images.lazy.service import LazyImages
from aenv.images.registry import RegistryClient


async def test_off_by_default_and_says_why(tmp_path: Path) -> None:
    async with RegistryClient() as client:
        lazy = LazyImages(Settings(state_dir=tmp_path / "s", cache_dir=tmp_path / "c"), client)
        assert not lazy.available
        assert lazy.describe() == {"lazy_images": False, "lazy_images_reason": "off (lazy_images = false)"}
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
